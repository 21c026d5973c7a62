//! The migration engine. It knows a VM only through [`vm::MigratableVm`].

pub mod vm;
