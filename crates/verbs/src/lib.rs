//! The client side of rnicd: a verbs API (work in progress).
pub mod tools;
