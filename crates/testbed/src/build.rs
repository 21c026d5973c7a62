//! Where this build's executables are, seen from a running test.

use std::path::PathBuf;

/// `target/<profile>`: cargo puts a test's executable in its `deps/`.
pub fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the running executable");
    let mut dir = exe.parent().expect("a directory").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// `target/<profile>/NAME`: an executable of this build.
pub fn build_bin(name: &str) -> PathBuf {
    build_dir().join(name)
}
