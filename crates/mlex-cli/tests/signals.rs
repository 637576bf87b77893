//! SIGINT and SIGTERM in every phase of `mlex generate` and `mlex serve`:
//! while the model loads, while MLX's CPU backend runs its compiler, while
//! tokens stream (in `cli.rs`), while serving (in `serve.rs`). Each phase is
//! reached by a gate the test holds, not by timing: a Hugging Face endpoint
//! that never answers holds the process in loading (downloading); a `g++` on
//! `PATH` that waits for the test's word holds it in the run-time compile.
#![cfg(unix)]

use mlex_testkit::*;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

fn mlex() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin("mlex"));
    c.env_remove("MLEX_ARCH_PATH");
    c
}

/// The child's status within `limit`, or None (it is still running).
fn wait_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The child's status within `limit`; past it the child is killed and the
/// test fails with `what`.
fn ended_within(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    wait_within(child, limit).unwrap_or_else(|| {
        let _ = child.kill();
        panic!("{what}")
    })
}

/// `ready()` once it gives `Some`, polled every 20 ms for at most `limit`
/// while `child` runs; fails if `child` ends first or time runs out, saying
/// it had not yet done `what`.
fn once<T>(
    child: &mut Child,
    limit: Duration,
    what: &str,
    mut ready: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(t) = ready() {
            return t;
        }
        if let Some(s) = child.try_wait().unwrap() {
            panic!("mlex ended ({s:?}) before {what}: {}", stderr_of(child));
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stderr_of(child: &mut Child) -> String {
    use std::io::Read;
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: signalling our own child by its pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

/// A Hugging Face endpoint that accepts and never answers: `mlex` given a
/// repo id under it stays in loading (downloading) until it is stopped.
struct SilentHub {
    listener: std::net::TcpListener,
    home: tempfile::TempDir,
}

impl SilentHub {
    fn start() -> SilentHub {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        SilentHub {
            listener,
            home: tempfile::tempdir().unwrap(),
        }
    }

    /// `mlex ARGS --model acme/held` against this endpoint.
    fn command(&self, args: &[&str]) -> Command {
        let mut c = mlex();
        c.args(args)
            .args(["--model", "acme/held"])
            .env(
                "HF_ENDPOINT",
                format!("http://{}", self.listener.local_addr().unwrap()),
            )
            .env("HF_HOME", self.home.path())
            .env_remove("HF_HUB_CACHE")
            .env_remove("HF_TOKEN")
            .env_remove("HF_HUB_OFFLINE")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }

    /// Waits (at most a minute) until `child` connects, i.e. is loading;
    /// returns the connection, to be held open.
    fn wait_until_loading(&self, child: &mut Child) -> std::net::TcpStream {
        let limit = Duration::from_secs(60);
        once(child, limit, "it asked the hub", || {
            match self.listener.accept() {
                Ok((conn, _)) => Some(conn),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                Err(e) => panic!("accept: {e}"),
            }
        })
    }
}

/// SIGINT while the model loads ends the process at once with 130, also
/// when it was started with SIGINT ignored, as a non-interactive shell
/// starts a background job (`mlex generate ... & kill -INT $!`): the
/// earlier handler was installed only when generation began, so such a
/// process ignored Ctrl-C until then and generated every token.
#[test]
fn sigint_while_loading_exits_130() {
    for ignored_at_start in [false, true] {
        let hub = SilentHub::start();
        let mut cmd = hub.command(&["generate", "--prompt-ids", "1,2,3", "--max-tokens", "400"]);
        if ignored_at_start {
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    libc::signal(libc::SIGINT, libc::SIG_IGN);
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().unwrap();
        let held = hub.wait_until_loading(&mut child);
        signal(&child, libc::SIGINT);
        let status = ended_within(
            &mut child,
            Duration::from_secs(30),
            &format!(
                "SIGINT while loading was ignored (SIGINT ignored at start: {ignored_at_start})"
            ),
        );
        drop(held);
        let err = stderr_of(&mut child);
        assert_eq!(
            status.code(),
            Some(130),
            "SIGINT ignored at start: {ignored_at_start}; {status:?}: {err}"
        );
    }
}

/// SIGTERM while `mlex serve` loads its model ends it at once with 143
/// (nothing is served yet, so there is nothing to drain).
#[test]
fn sigterm_while_serve_loads_exits_143() {
    let hub = SilentHub::start();
    let mut child = hub.command(&["serve", "--port", "0"]).spawn().unwrap();
    let held = hub.wait_until_loading(&mut child);
    signal(&child, libc::SIGTERM);
    let status = ended_within(
        &mut child,
        Duration::from_secs(30),
        "SIGTERM while loading did not end `mlex serve`",
    );
    drop(held);
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(143), "{status:?}: {err}");
}

/// A `g++` first on `PATH` whose first build (not the `--version` probe)
/// says so and waits for the test's word; then the real compiler runs.
struct GatedCompiler {
    dir: tempfile::TempDir,
}

impl GatedCompiler {
    fn new() -> GatedCompiler {
        let dir = tempfile::tempdir().unwrap();
        let real = ["/usr/bin/g++", "/usr/local/bin/g++"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("g++ (MLX's CPU backend needs it at run time)");
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
        let g = dir.path().display();
        let script = format!(
            "#!/bin/sh\n\
             case \"$1\" in --version) exec {real} \"$@\";; esac\n\
             if mkdir {g}/first 2>/dev/null; then\n\
               : > {g}/compiling\n\
               while [ ! -e {g}/go ]; do sleep 0.05; done\n\
             fi\n\
             exec {real} \"$@\"\n"
        );
        let wrapper = bin.join("g++");
        std::fs::write(&wrapper, script).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
        GatedCompiler { dir }
    }

    /// MLX's kernel cache for runs under this gate (fresh, so it compiles).
    fn tmpdir(&self) -> PathBuf {
        self.dir.path().join("tmp")
    }

    /// `mlex generate` on a hybrid fixture with the gate first on `PATH`,
    /// in its own process group (as a terminal's foreground job).
    fn generate(&self) -> Child {
        let path = format!(
            "{}:{}",
            self.dir.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        mlex()
            .args([
                "generate",
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "3000",
                "--ignore-eos",
            ])
            .arg("--model")
            .arg(path_of(&fixture("qwen3_5-f32")))
            .env("PATH", path)
            .env("TMPDIR", self.tmpdir())
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Waits (at most two minutes) until MLX runs the compiler.
    fn wait_until_compiling(&self, child: &mut Child) {
        let compiling = self.dir.path().join("compiling");
        let limit = Duration::from_secs(120);
        once(child, limit, "MLX ran the compiler", || {
            compiling.exists().then_some(())
        });
    }

    fn release(&self) {
        std::fs::write(self.dir.path().join("go"), "").unwrap();
    }

    /// `mlex generate` sent a signal by `send` while its compiler is held,
    /// which must end it with 130 within two minutes (else: `what`); its
    /// stderr.
    fn interrupted(&self, send: impl FnOnce(&Child), what: &str) -> String {
        let mut child = self.generate();
        self.wait_until_compiling(&mut child);
        send(&child);
        self.release();
        let status = ended_within(&mut child, Duration::from_secs(120), what);
        let err = stderr_of(&mut child);
        assert_eq!(status.code(), Some(130), "{status:?}: {err}");
        err
    }
}

/// SIGINT while MLX's CPU backend runs `g++` to build a fused kernel.
/// Sent to mlex alone (`kill -INT`), the compiler finishes and generation
/// stops after the current token, with the summary and 130. Sent to the
/// whole process group, as a terminal's Ctrl-C is, the compiler (MLX starts
/// it through `popen`, whose shell unblocks the signal) dies with it: the
/// failed build must come out as the interrupt (130, "interrupted"), not
/// as an MLX error, and leave nothing in MLX's kernel cache that breaks the
/// next run.
#[test]
fn sigint_during_the_run_time_compile_stops_cleanly() {
    // To mlex alone.
    let gate = GatedCompiler::new();
    let err = gate.interrupted(
        |child| signal(child, libc::SIGINT),
        "SIGINT during the compile did not stop generation",
    );
    assert!(
        err.contains("generation:")
            && err.contains("interrupted")
            && !err.lines().any(|l| l.starts_with("error:")),
        "{err}"
    );

    // To the process group, as Ctrl-C at a terminal.
    let gate = GatedCompiler::new();
    let to_group = |child: &Child| {
        // SAFETY: signalling the child's own process group.
        assert_eq!(unsafe { libc::kill(-(child.id() as i32), libc::SIGINT) }, 0);
    };
    let err = gate.interrupted(
        to_group,
        "Ctrl-C during the compile did not stop generation",
    );
    assert!(
        err.contains("interrupted")
            && !err.lines().any(|l| l.starts_with("error:"))
            && !err.contains("panicked"),
        "{err}"
    );
    // The same kernel cache serves the next run.
    let out = mlex()
        .args(["generate", "--prompt-ids", "1,2,3", "--max-tokens", "4"])
        .arg("--model")
        .arg(path_of(&fixture("qwen3_5-f32")))
        .env("TMPDIR", gate.tmpdir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
