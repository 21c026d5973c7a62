//! migration (work in progress)
