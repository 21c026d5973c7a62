// SPDX-License-Identifier: GPL-2.0-or-later
//! Generates the libibverbs structs from the system's <infiniband/verbs.h>
//! (Debian's libibverbs-dev): the layouts the drop-in must match are those
//! that programs were compiled against, so they come from the same header,
//! with bindgen's size and offset tests.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=/usr/include/infiniband/verbs.h");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    bindgen::Builder::default()
        .header_contents("wrap.h", "#include <infiniband/verbs.h>\n")
        .allowlist_type("ibv_.*|verbs_.*|_ibv_.*")
        .allowlist_var("IBV_.*|IB_.*")
        .derive_default(true)
        .prepend_enum_name(false)
        .layout_tests(true)
        .generate()
        .expect("bindgen over <infiniband/verbs.h> (apt-get install libibverbs-dev)")
        .write_to_file(out.join("verbs_sys.rs"))
        .expect("write bindings");
}
