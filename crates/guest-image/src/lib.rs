//! Where the guest firmware built from `crates/guest` lives.

/// Absolute path of the firmware ELF built with this binary.
pub const ELF_PATH: &str = env!("TRANSIT_GUEST_ELF");

/// The firmware path to use by default: `TRANSIT_FIRMWARE` if set, else the
/// one built with this binary.
pub fn default_path() -> std::path::PathBuf {
    std::env::var_os("TRANSIT_FIRMWARE").map(Into::into).unwrap_or_else(|| ELF_PATH.into())
}
