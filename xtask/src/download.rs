//! Downloads checked by sha256 into a cache shared by every clone
//! (`$MLEX_CACHE`, else `$XDG_CACHE_HOME/mlex`, else `~/.cache/mlex`).

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The cache folder for downloads and other machine-wide state.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MLEX_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("mlex");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| ".".into());
    PathBuf::from(home).join(".cache/mlex")
}

/// Hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file =
        fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// Returns the cached file for `url`, downloading it first if needed. A file
/// whose sha256 differs from `sha256` is never returned.
pub fn fetch(url: &str, sha256: &str) -> Result<PathBuf> {
    let name = url.rsplit('/').next().unwrap_or("download");
    let dir = cache_dir().join("downloads");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(name);
    if path.exists() {
        if sha256_file(&path)? == sha256 {
            return Ok(path);
        }
        eprintln!(
            "xtask: {} has the wrong sha256; downloading again",
            path.display()
        );
        fs::remove_file(&path)?;
    }
    eprintln!("xtask: downloading {url}");
    // Per process: two runs fetching the same file must not write one file.
    let partial = path.with_extension(format!("partial.{}", std::process::id()));
    // The platform's roots, not Mozilla's: machines behind a TLS-inspecting
    // proxy add its certificate there.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(
            ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::PlatformVerifier)
                .build(),
        )
        .build()
        .into();
    let response = agent
        .get(url)
        .call()
        .with_context(|| format!("cannot download {url} (is the network reachable?)"))?;
    let mut reader = response.into_body().into_reader();
    let mut out = fs::File::create(&partial)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0usize;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        total += n;
    }
    out.flush()?;
    let got = format!("{:x}", hasher.finalize());
    if got != sha256 {
        let _ = fs::remove_file(&partial);
        bail!("{url}: sha256 is {got}, expected {sha256} ({total} bytes); refusing to use it");
    }
    fs::rename(&partial, &path)?;
    eprintln!(
        "xtask: saved {} ({:.1} MB)",
        path.display(),
        total as f64 / 1e6
    );
    Ok(path)
}

/// Extracts the entries of a zip file whose names start with one of
/// `prefixes` into `dest`.
pub fn unzip(zip_path: &Path, prefixes: &[&str], dest: &Path) -> Result<()> {
    let file = fs::File::open(zip_path)?;
    let mut archive = zip::ZipArchive::new(file)
        .with_context(|| format!("{} is not a readable zip", zip_path.display()))?;
    for i in 0..archive.len() {
        let mut entry = archive.by_index(i)?;
        let Some(name) = entry.enclosed_name() else {
            continue;
        };
        if !prefixes
            .iter()
            .any(|p| name.to_string_lossy().starts_with(p))
        {
            continue;
        }
        let out = dest.join(&name);
        if entry.is_dir() {
            fs::create_dir_all(&out)?;
            continue;
        }
        if let Some(parent) = out.parent() {
            fs::create_dir_all(parent)?;
        }
        let mut f = fs::File::create(&out)?;
        std::io::copy(&mut entry, &mut f)?;
        #[cfg(unix)]
        if let Some(mode) = entry.unix_mode() {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&out, fs::Permissions::from_mode(mode))?;
        }
    }
    Ok(())
}
