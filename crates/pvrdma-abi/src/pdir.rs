//! Page directories: how the driver hands the device a list of guest pages
//! (ring buffers, memory regions). Two levels: the directory page holds up to
//! 512 guest-physical addresses of tables, each table up to 512 addresses of
//! pages; page `i` of the list is slot `i & 0x1ff` of table `(i >> 9) & 0x1ff`.
//! One directory, so at most 512 * 512 pages (1 GiB).

/// Page-index bits that select the table.
pub const PDIR_TABLE_SHIFT: u32 = 9;
/// Entries in a directory or table page.
pub const PDIR_ENTRIES: u64 = 512;
/// The most pages one directory lists.
pub const PAGE_DIR_MAX_PAGES: u32 = 512 * 512;
/// The most pages of a fast-registration page list.
pub const MAX_FAST_REG_PAGES: u32 = 128;

/// The table that lists page `idx`.
pub const fn pdir_table(idx: u32) -> u32 {
    (idx >> PDIR_TABLE_SHIFT) & 0x1ff
}

/// The slot in its table that lists page `idx`.
pub const fn pdir_page(idx: u32) -> u32 {
    idx & 0x1ff
}

/// How many tables a list of `npages` pages needs (0 for none).
pub const fn pdir_ntables(npages: u32) -> u32 {
    if npages == 0 {
        0
    } else {
        pdir_table(npages - 1) + 1
    }
}

/// Byte offset, in the directory page, of the entry that holds table `t`.
pub const fn pdir_dir_entry_offset(table: u32) -> u64 {
    table as u64 * 8
}

/// Byte offset, in a table page, of the entry that holds page `idx`.
pub const fn pdir_table_entry_offset(idx: u32) -> u64 {
    pdir_page(idx) as u64 * 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_levels_of_512() {
        assert_eq!((pdir_table(0), pdir_page(0)), (0, 0));
        assert_eq!((pdir_table(511), pdir_page(511)), (0, 511));
        assert_eq!((pdir_table(512), pdir_page(512)), (1, 0));
        assert_eq!((pdir_table(PAGE_DIR_MAX_PAGES - 1), pdir_page(PAGE_DIR_MAX_PAGES - 1)), (511, 511));
        assert_eq!(pdir_ntables(0), 0);
        assert_eq!(pdir_ntables(1), 1);
        assert_eq!(pdir_ntables(512), 1);
        assert_eq!(pdir_ntables(513), 2);
        assert_eq!(pdir_ntables(PAGE_DIR_MAX_PAGES), 512);
        assert_eq!(pdir_table_entry_offset(513), 8);
        assert_eq!(pdir_dir_entry_offset(3), 24);
    }
}
