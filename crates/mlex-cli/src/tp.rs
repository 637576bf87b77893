//! `--tp N`: one command as N ranks of a tensor-parallel group.
//!
//! Without `MLX_RANK` in the environment, `mlex ... --tp N` is the
//! launcher: it writes a hostfile of N loopback addresses (ring) or picks
//! one port (NCCL), starts N copies of itself with MLX's variables set, one
//! per rank, shows rank 0's output and waits. When a rank fails, the
//! others are stopped and the error names the rank; when the launcher
//! dies, its ranks get SIGTERM (`PR_SET_PDEATHSIG`), so nothing is left
//! waiting for a peer. With `MLX_RANK` set (by the launcher, `mlx.launch`
//! or a user), the process is one rank: it joins the group
//! ([`join`]) and runs the command on its part of the model.

use mlex_core::distributed::{CollectiveBackend, Shard};
use mlex_core::error::{Error, Result};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How long a rank waits for its peers to join before it gives up
/// (MLX's ring backend would wait in `accept` forever).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// What this process is for a command run with `--tp tp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// One device (`--tp 1`).
    Single,
    /// Start `N` ranks and wait for them.
    Launch(u32),
    /// One rank of a group of `N` (MLX's environment names it).
    Rank(u32),
}

/// The role of this process under `--tp tp`: with `MLX_RANK` set, one
/// rank of a group of `tp`, on NCCL a group of one too (the collectives'
/// code path and cost on one GPU; MLX's ring backend takes no group of
/// one); else one device, or the launcher of `tp` ranks.
pub fn role(tp: u32) -> Role {
    let ranked = std::env::var_os("MLX_RANK").is_some();
    match tp {
        0 => Role::Single,
        1 if ranked && backend() == CollectiveBackend::Nccl => Role::Rank(1),
        1 => Role::Single,
        n if ranked => Role::Rank(n),
        n => Role::Launch(n),
    }
}

/// Whether this process is a rank of a group other than rank 0 (MLX's
/// environment names it).
pub fn follower() -> bool {
    std::env::var("MLX_RANK").is_ok_and(|r| r.trim() != "0")
}

/// `flow` as every rank of `shard` will take it: a stop on any rank stops
/// them all at this token (one device: `flow` itself).
pub fn agreed(shard: Option<&Shard>, flow: mlex_generate::Flow) -> Result<mlex_generate::Flow> {
    use mlex_generate::Flow;
    match shard {
        Some(s) if s.any(flow == Flow::Stop)? => Ok(Flow::Stop),
        Some(_) => Ok(Flow::Continue),
        None => Ok(flow),
    }
}

/// The collective backend of this process's default device.
pub fn backend() -> CollectiveBackend {
    if mlex_core::device::default_is_cuda_gpu() {
        CollectiveBackend::Nccl
    } else {
        CollectiveBackend::Ring
    }
}

/// Joins the group of `size` ranks MLX's environment describes, within
/// [`JOIN_TIMEOUT`] (after it, the process exits with an error naming the
/// rank and the hostfile).
pub fn join(size: u32) -> Result<Shard> {
    if backend() == CollectiveBackend::Ring {
        check_environment(size)?;
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = done.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < JOIN_TIMEOUT {
            if watch.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "error: --tp {size}: rank {} waited {} s for its peers (MLX_HOSTFILE={}); giving up",
            std::env::var("MLX_RANK").unwrap_or_default(),
            JOIN_TIMEOUT.as_secs(),
            std::env::var("MLX_HOSTFILE").unwrap_or_else(|_| "(not set)".into()),
        );
        // SAFETY: ends the process without running MLX's static
        // destructors under a thread that is inside MLX (see `interrupt`).
        unsafe { libc::_exit(1) };
    });
    let shard = Shard::join(backend(), size as usize);
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    match shard {
        Err(e) if backend() == CollectiveBackend::Ring => Err(own_address_taken().unwrap_or(e)),
        other => other,
    }
}

/// The error to give when this rank's own `ip:port` of the hostfile cannot
/// be bound (a port in use): MLX's own says only that the group failed.
fn own_address_taken() -> Option<Error> {
    let rank: usize = std::env::var("MLX_RANK").ok()?.trim().parse().ok()?;
    let path = PathBuf::from(std::env::var_os("MLX_HOSTFILE")?);
    let hosts: Vec<Vec<String>> =
        serde_json::from_str(&std::fs::read_to_string(&path).ok()?).ok()?;
    let addr = hosts.get(rank)?.first()?;
    let taken = std::net::TcpListener::bind(addr.as_str()).err()?;
    Some(Error::invalid(
        "MLX_HOSTFILE",
        format!(
            "{}: rank {rank}'s address {addr} cannot be bound ({taken}); is another process using it?",
            path.display()
        ),
    ))
}

/// The ring backend's rank and hostfile, checked before MLX reads them
/// (MLX waits for peers that a wrong hostfile never brings).
fn check_environment(size: u32) -> Result<()> {
    let bad = |key: &str, message: String| Err(Error::invalid(key, message));
    let rank = std::env::var("MLX_RANK").unwrap_or_default();
    let Ok(rank) = rank.trim().parse::<u32>() else {
        return bad("MLX_RANK", format!("`{rank}` is not a rank number"));
    };
    let Some(path) = std::env::var_os("MLX_HOSTFILE").map(PathBuf::from) else {
        return bad(
            "MLX_HOSTFILE",
            "not set: the ring backend needs a JSON list of [\"ip:port\"] lists, one per rank"
                .into(),
        );
    };
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let hosts: Vec<Vec<String>> = serde_json::from_str(&text).map_err(|e| {
        Error::invalid(
            "MLX_HOSTFILE",
            format!(
                "{}: not a JSON list of [\"ip:port\"] lists, one per rank ({e})",
                path.display()
            ),
        )
    })?;
    if hosts.len() != size as usize {
        return bad(
            "MLX_HOSTFILE",
            format!(
                "{} lists {} ranks, but --tp asks for {size}",
                path.display(),
                hosts.len()
            ),
        );
    }
    if rank >= size {
        return bad("MLX_RANK", format!("rank {rank} is not below --tp {size}"));
    }
    for (r, addrs) in hosts.iter().enumerate() {
        let ok = !addrs.is_empty()
            && addrs.iter().all(|a| {
                a.rsplit_once(':')
                    .is_some_and(|(ip, port)| !ip.is_empty() && port.parse::<u16>().is_ok())
            });
        if !ok {
            return bad(
                "MLX_HOSTFILE",
                format!(
                    "{}: rank {r} has no valid \"ip:port\" ({addrs:?})",
                    path.display()
                ),
            );
        }
    }
    Ok(())
}

/// Starts `n` ranks of this very command line and waits for all of them.
pub fn launch(n: u32) -> Result<()> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::Other(format!("--tp {n}: cannot find the mlex binary: {e}")))?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let dir = scratch_dir()?;
    let result = (|| {
        let envs = environments(n, backend(), &dir)?;
        let mut children = Vec::with_capacity(n as usize);
        for (rank, env) in envs.into_iter().enumerate() {
            let mut cmd = Command::new(&exe);
            cmd.args(&args)
                .envs(env)
                .stdin(if rank == 0 {
                    Stdio::inherit()
                } else {
                    Stdio::null()
                })
                .stdout(if rank == 0 {
                    Stdio::inherit()
                } else {
                    Stdio::null()
                })
                .stderr(if rank == 0 {
                    Stdio::inherit()
                } else {
                    Stdio::piped()
                });
            die_with_parent(&mut cmd);
            let mut child = cmd
                .spawn()
                .map_err(|e| Error::Other(format!("--tp {n}: cannot start rank {rank}: {e}")))?;
            if let Some(err) = child.stderr.take() {
                forward_failures(err);
            }
            children.push(child);
        }
        // A signal to the launcher goes on to rank 0 (which stops or
        // drains, and the others with it); a second stops every rank.
        let pids: Vec<u32> = children.iter().map(Child::id).collect();
        let forward = move |_sig: i32, earlier: usize| forward_signal(&pids, earlier);
        crate::interrupt::launching(forward, || supervise(n, children))
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Passes on what a rank other than 0 says on stderr that only it can say
/// (a warning; an error or a panic, with every line after it: the rank is
/// failing) and drops the progress and summary lines that rank 0 prints as
/// well.
fn forward_failures(err: std::process::ChildStderr) {
    std::thread::spawn(move || {
        use std::io::BufRead;
        let failing = ["error", "Error", "thread '", "terminate", "libc++abi"];
        let mut failed = false;
        for line in std::io::BufReader::new(err).lines().map_while(|l| l.ok()) {
            failed |= failing.iter().any(|p| line.starts_with(p));
            if failed || line.starts_with("warning") {
                eprintln!("{line}");
            }
        }
    });
}

/// One process's environment variables.
type Env = Vec<(String, String)>;

/// Each rank's MLX variables. (Each rank, an `mlex` process, compiles its
/// CPU kernels in a folder of its own: `crate::cpu_kernels`.)
fn environments(n: u32, backend: CollectiveBackend, dir: &std::path::Path) -> Result<Vec<Env>> {
    let rank_env = |r: u32| vec![("MLX_RANK".to_owned(), r.to_string())];
    match backend {
        CollectiveBackend::Ring => {
            let ports = free_ports(n as usize)?;
            let hosts: Vec<Vec<String>> = ports
                .iter()
                .map(|p| vec![format!("127.0.0.1:{p}")])
                .collect();
            let hostfile = dir.join("hosts.json");
            std::fs::write(&hostfile, serde_json::to_string(&hosts).expect("json"))
                .map_err(|e| Error::Other(format!("{}: {e}", hostfile.display())))?;
            let envs = (0..n)
                .map(|r| {
                    let mut env = rank_env(r);
                    env.push(("MLX_HOSTFILE".into(), hostfile.display().to_string()));
                    env
                })
                .collect();
            Ok(envs)
        }
        CollectiveBackend::Nccl => {
            let port = free_ports(1)?[0];
            let envs = (0..n)
                .map(|r| {
                    let mut env = rank_env(r);
                    env.extend([
                        ("MLX_WORLD_SIZE".to_owned(), n.to_string()),
                        ("NCCL_HOST_IP".to_owned(), "127.0.0.1".to_owned()),
                        ("NCCL_PORT".to_owned(), port.to_string()),
                        // NVLink multicast stays off (it needs a driver
                        // feature shared machines do not grant).
                        ("NCCL_NVLS_ENABLE".to_owned(), "0".to_owned()),
                        ("CUDA_VISIBLE_DEVICES".to_owned(), r.to_string()),
                    ]);
                    env
                })
                .collect();
            Ok(envs)
        }
    }
}

/// Ports the system had free a moment ago (bound to port 0 and released;
/// each rank binds its own right after).
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| Error::Other(format!("--tp: no free loopback port: {e}")))?;
    listeners
        .iter()
        .map(|l| {
            l.local_addr()
                .map(|a| a.port())
                .map_err(|e| Error::Other(format!("--tp: {e}")))
        })
        .collect()
}

fn scratch_dir() -> Result<PathBuf> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("mlex-tp-{}-{stamp}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::Other(format!("--tp: {}: {e}", dir.display())))?;
    Ok(dir)
}

/// The launcher's signal handling: rank 0 hears of the first signal, every
/// rank is killed on a second.
#[cfg(unix)]
fn forward_signal(pids: &[u32], earlier: usize) {
    for (rank, &pid) in pids.iter().enumerate() {
        let sig = match (earlier, rank) {
            (0, 0) => crate::interrupt::FROM_LAUNCHER,
            (0, _) => continue,
            _ => libc::SIGKILL,
        };
        // SAFETY: sends a signal to a child this process started.
        unsafe { libc::kill(pid as libc::pid_t, sig) };
    }
}

#[cfg(not(unix))]
fn forward_signal(_pids: &[u32], _earlier: usize) {}

#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; it runs in the child between
    // fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

/// Waits for every rank; the first to fail stops the others.
fn supervise(n: u32, mut children: Vec<Child>) -> Result<()> {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank].is_some() {
                continue;
            }
            let status = child
                .try_wait()
                .map_err(|e| Error::Other(format!("--tp {n}: rank {rank}: {e}")))?;
            if let Some(status) = status {
                done[rank] = Some(status);
                if !status.success() {
                    stop(&mut children, &done);
                    return Err(Error::Other(format!(
                        "--tp {n}: rank {rank} {}; the other ranks were stopped",
                        describe(status)
                    )));
                }
            }
        }
        if done.iter().all(Option::is_some) {
            // Every rank ended well (a server drained after a signal):
            // the launcher's status is theirs.
            crate::interrupt::reset();
            return Ok(());
        }
        // Polling, not blocking on one child: whichever rank fails first
        // must stop the rest.
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stop(children: &mut [Child], done: &[Option<ExitStatus>]) {
    for (child, d) in children.iter_mut().zip(done) {
        if d.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => "exited".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_ranks_share_one_hostfile_of_distinct_loopback_ports() {
        let dir = scratch_dir().unwrap();
        let envs = environments(3, CollectiveBackend::Ring, &dir).unwrap();
        assert_eq!(envs.len(), 3);
        let file = &envs[0].iter().find(|(k, _)| k == "MLX_HOSTFILE").unwrap().1;
        let hosts: Vec<Vec<String>> =
            serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
        assert_eq!(hosts.len(), 3);
        let mut ports: Vec<&str> = hosts.iter().map(|h| h[0].as_str()).collect();
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), 3, "{hosts:?}");
        for (r, env) in envs.iter().enumerate() {
            assert!(env.contains(&("MLX_RANK".into(), r.to_string())));
            assert!(env.iter().any(|(k, v)| k == "MLX_HOSTFILE" && v == file));
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn nccl_ranks_keep_multicast_off_and_get_one_gpu_each() {
        let dir = scratch_dir().unwrap();
        let envs = environments(2, CollectiveBackend::Nccl, &dir).unwrap();
        for (r, env) in envs.iter().enumerate() {
            assert!(env.contains(&("NCCL_NVLS_ENABLE".into(), "0".into())));
            assert!(env.contains(&("MLX_WORLD_SIZE".into(), "2".into())));
            assert!(env.contains(&("CUDA_VISIBLE_DEVICES".into(), r.to_string())));
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
