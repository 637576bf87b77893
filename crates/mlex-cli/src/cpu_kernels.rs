//! A folder of its own for each running `mlex` process's compiled CPU
//! kernels.
//!
//! MLX's CPU backend (`mlx/backend/cpu/compiled.cpp`, 0.32) compiles each
//! fused kernel with `g++` into `$TMPDIR/mlx/<version>/cpu` and loads it
//! from there, taking a library that exists as finished. Two processes that
//! need the same kernel at the same moment (tests running `mlex` in
//! parallel on a fresh machine, a server beside a `generate`, the ranks of
//! a `--tp` launch) then load each other's half-written file ("file too
//! short", seen in a clean-clone test run) or compile a source the other is
//! rewriting. So each process sets its `TMPDIR` to a folder no running
//! `mlex` holds: `mlex-cpu-N` under the temporary directory, the first `N`
//! whose lock (`mlex-cpu-N.lock`, `flock`, released when the process exits
//! however it ends) is free. The folders stay between runs, so a process
//! run alone finds the kernels of the last one in `mlex-cpu-0`.

use std::fs::File;
use std::path::{Path, PathBuf};

/// Folders tried; a process finding all of them held keeps the shared
/// temporary directory (MLX's own behaviour).
const FOLDERS: u32 = 64;

/// The first `mlex-cpu-N` folder under `base` whose lock no one holds,
/// created, with the lock (held while the file is open).
fn claim(base: &Path) -> Option<(PathBuf, File)> {
    (0..FOLDERS).find_map(|n| {
        let dir = base.join(format!("mlex-cpu-{n}"));
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.with_extension("lock"))
            .ok()?;
        if !try_lock(&lock) {
            return None;
        }
        std::fs::create_dir_all(&dir).ok()?;
        Some((dir, lock))
    })
}

#[cfg(unix)]
fn try_lock(f: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor the caller owns; the lock goes with
    // the open file.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

#[cfg(not(unix))]
fn try_lock(_: &File) -> bool {
    false
}

/// Points `TMPDIR` at this process's own folder, held until it exits. Call
/// before any thread starts (the environment is the process's).
pub(crate) fn use_own_folder() {
    if let Some((dir, lock)) = claim(&std::env::temp_dir()) {
        std::env::set_var("TMPDIR", &dir);
        // Held for the process's life: the kernel cannot hand the folder to
        // another process before this one has exited.
        std::mem::forget(lock);
    }
}

/// Where MLX's CPU backend puts this process's compiled kernels.
pub(crate) fn dir() -> PathBuf {
    std::env::temp_dir()
        .join("mlx")
        .join(mlex_core::device::mlx_version())
        .join("cpu")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_at_the_same_time_never_share_a_kernel_folder() {
        let base = tempfile::tempdir().unwrap();
        let (first, first_lock) = claim(base.path()).unwrap();
        let (second, second_lock) = claim(base.path()).unwrap();
        assert_eq!(first, base.path().join("mlex-cpu-0"));
        assert_eq!(second, base.path().join("mlex-cpu-1"));
        assert!(first.is_dir() && second.is_dir());
        // The first one's exit frees its folder for the next process.
        drop(first_lock);
        let (again, _again_lock) = claim(base.path()).unwrap();
        assert_eq!(again, first);
        drop(second_lock);
    }
}
