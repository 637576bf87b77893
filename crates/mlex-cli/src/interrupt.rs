//! SIGINT and SIGTERM, safe in every phase of the process.
//!
//! What a user gets: the first Ctrl-C during generation stops it after the
//! current token (the text so far and the summary line are still printed,
//! and the process exits 130); a second one, or one in any other phase
//! (loading, compiling, waiting at a chat prompt, exiting), exits 130 at
//! once. SIGTERM exits 143 at once, except while `mlex serve` is serving,
//! where SIGTERM or Ctrl-C drains the requests in flight and a second
//! signal exits at once.
//!
//! How, and why not a plain signal handler: [`install`] blocks both
//! signals in the main thread, so every thread the process starts later
//! (MLX's, tokio's, ours) inherits the block, and one thread takes them
//! with `sigwait`; threads that libraries started before `main` get a
//! handler that hands the signal to that thread. So
//! - no code runs in signal context, and the immediate exits are
//!   `_exit`, which runs no `atexit` handlers or C++ static destructors:
//!   `exit` from a second thread while the main thread is inside MLX
//!   destroys MLX's globals under it (the rare SIGSEGV seen on Ctrl-C);
//! - a signal is taken whatever the disposition says at that moment: the
//!   old handler was installed only when generation started, so a process
//!   started with SIGINT ignored (a background job of a non-interactive
//!   shell) ignored Ctrl-C while loading;
//! - the compiler MLX's CPU backend starts at run time to build fused
//!   kernels (`g++` through `popen`) inherits the block and finishes, where
//!   a terminal's Ctrl-C used to kill it and turn an interrupt into
//!   "Failed to compile function".

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Interrupts taken since the last [`reset`].
static COUNT: AtomicUsize = AtomicUsize::new(0);
/// What the process is doing, for what a signal means.
static PHASE: AtomicU8 = AtomicU8::new(IDLE);
/// Asks a running server to drain; false when it is not serving yet.
type StopHook = Box<dyn Fn() -> bool + Send>;
static STOP: Mutex<Option<StopHook>> = Mutex::new(None);

/// SIGINT's number (2 on every Unix).
const SIGINT: i32 = 2;

const IDLE: u8 = 0;
const GENERATING: u8 = 1;
const SERVING: u8 = 2;
/// The launcher of `--tp` ranks: the first signal goes on to rank 0.
const LAUNCHING: u8 = 3;
/// A serving rank other than 0: rank 0 decides when it ends.
const FOLLOWING: u8 = 4;

/// The signal the launcher of `--tp` ranks sends rank 0 for one it took:
/// an interrupt (SIGINT's meaning) that never counts as a second one, since
/// a terminal's Ctrl-C reaches rank 0 itself too.
#[cfg(unix)]
pub const FROM_LAUNCHER: i32 = libc::SIGUSR1;
#[cfg(not(unix))]
pub const FROM_LAUNCHER: i32 = 10;

/// Passes a signal on to the ranks (`earlier`: signals the launcher took
/// before this one).
type Forward = Box<dyn Fn(i32, usize) + Send>;
static FORWARD: Mutex<Option<Forward>> = Mutex::new(None);

/// Takes SIGINT and SIGTERM away from the default actions; call first in
/// `main`, before any thread starts (later calls do nothing).
pub fn install() {
    #[cfg(unix)]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(unix::install);
    }
}

/// What a signal does now: called on the signal thread.
fn on_signal(sig: i32) {
    let phase = PHASE.load(Ordering::SeqCst);
    if phase == FOLLOWING {
        return;
    }
    let sig = if sig == FROM_LAUNCHER {
        if COUNT.load(Ordering::SeqCst) > 0 {
            // The same interrupt, already taken from the terminal.
            return;
        }
        SIGINT
    } else {
        sig
    };
    let earlier = COUNT.fetch_add(1, Ordering::SeqCst);
    let code = 128 + sig;
    match phase {
        LAUNCHING => {
            if let Some(f) = FORWARD.lock().ok().as_ref().and_then(|h| h.as_ref()) {
                f(sig, earlier);
            }
            if earlier > 0 {
                exit_now(code);
            }
        }
        GENERATING if earlier == 0 && sig == SIGINT => {}
        SERVING if earlier == 0 => {
            let drained = STOP
                .lock()
                .ok()
                .and_then(|h| h.as_ref().map(|h| h()))
                .unwrap_or(false);
            if !drained {
                exit_now(code);
            }
        }
        _ => exit_now(code),
    }
}

/// Ends the process without running destructors (see the module docs).
fn exit_now(code: i32) -> ! {
    #[cfg(unix)]
    // SAFETY: `_exit` ends the process; it is safe to call from any thread.
    unsafe {
        libc::_exit(code)
    }
    #[cfg(not(unix))]
    std::process::exit(code)
}

/// Whether Ctrl-C was pressed since the last [`reset`].
pub fn requested() -> bool {
    COUNT.load(Ordering::SeqCst) > 0
}

/// Forgets earlier interrupts (a chat turn that was cut short continues
/// with the next one).
pub fn reset() {
    COUNT.store(0, Ordering::SeqCst);
}

/// Runs `generate` with Ctrl-C stopping it after the current token (the
/// `on_token` callbacks check [`requested`]); returns its result and whether
/// it was interrupted.
pub fn generating<T>(generate: impl FnOnce() -> T) -> (T, bool) {
    PHASE.store(GENERATING, Ordering::SeqCst);
    let out = generate();
    PHASE.store(IDLE, Ordering::SeqCst);
    (out, requested())
}

/// Runs `serve` with the first SIGTERM or Ctrl-C calling `stop` (which
/// returns false while nothing is served yet: then the process exits at
/// once) and a second exiting at once.
pub fn serving<T>(stop: impl Fn() -> bool + Send + 'static, serve: impl FnOnce() -> T) -> T {
    if let Ok(mut h) = STOP.lock() {
        *h = Some(Box::new(stop));
    }
    PHASE.store(SERVING, Ordering::SeqCst);
    let out = serve();
    PHASE.store(IDLE, Ordering::SeqCst);
    // A drained server ends as asked: its exit status is its own, not 130.
    reset();
    out
}

/// Runs `launch` (the launcher of `--tp` ranks) with each signal handed to
/// `forward` (which sends rank 0 [`FROM_LAUNCHER`] the first time and
/// stops every rank after); a second signal then exits the launcher.
pub fn launching<T>(
    forward: impl Fn(i32, usize) + Send + 'static,
    launch: impl FnOnce() -> T,
) -> T {
    if let Ok(mut h) = FORWARD.lock() {
        *h = Some(Box::new(forward));
    }
    PHASE.store(LAUNCHING, Ordering::SeqCst);
    let out = launch();
    PHASE.store(IDLE, Ordering::SeqCst);
    out
}

/// Runs `follow` (a serving rank other than 0) with signals ignored: rank
/// 0 drains the requests in flight and then ends this rank too; should
/// rank 0 go away, this rank's next collective fails and it exits.
pub fn following<T>(follow: impl FnOnce() -> T) -> T {
    PHASE.store(FOLLOWING, Ordering::SeqCst);
    let out = follow();
    PHASE.store(IDLE, Ordering::SeqCst);
    out
}

#[cfg(unix)]
mod unix {
    use std::mem::MaybeUninit;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The signal thread, for [`forward`] (0 until it runs).
    static SIGNAL_THREAD: AtomicUsize = AtomicUsize::new(0);

    fn signal_set() -> libc::sigset_t {
        let mut set = MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: sigemptyset initialises the set; sigaddset adds to it.
        unsafe {
            libc::sigemptyset(set.as_mut_ptr());
            libc::sigaddset(set.as_mut_ptr(), libc::SIGINT);
            libc::sigaddset(set.as_mut_ptr(), libc::SIGTERM);
            libc::sigaddset(set.as_mut_ptr(), super::FROM_LAUNCHER);
            set.assume_init()
        }
    }

    /// The handler, for the threads that libraries start before `main`
    /// (OpenBLAS starts its workers when it is loaded) and that do not
    /// block the signals: it hands the signal to the signal thread
    /// (`pthread_kill` is async-signal-safe), or ends the process when
    /// there is none yet.
    extern "C" fn forward(sig: libc::c_int) {
        let t = SIGNAL_THREAD.load(Ordering::SeqCst);
        // SAFETY: async-signal-safe calls only.
        unsafe {
            if t == 0 || libc::pthread_kill(t as libc::pthread_t, sig) != 0 {
                libc::_exit(128 + sig);
            }
        }
    }

    pub(super) fn install() {
        let set = signal_set();
        // SAFETY: changes this thread's signal mask; threads started from
        // here on inherit it.
        let blocked =
            unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) } == 0;
        if !blocked {
            return;
        }
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("mlex-signals".into())
            .spawn(move || {
                // SAFETY: pthread_self has no preconditions.
                let me = unsafe { libc::pthread_self() };
                SIGNAL_THREAD.store(me as usize, Ordering::SeqCst);
                let _ = ready_tx.send(());
                loop {
                    let mut sig: libc::c_int = 0;
                    // SAFETY: waits for one of the blocked signals in `set`.
                    if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                        super::on_signal(sig);
                    }
                }
            });
        if spawned.is_err() || ready_rx.recv().is_err() {
            // Nobody would take them: give the defaults back.
            // SAFETY: as above.
            unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
            return;
        }
        for sig in [libc::SIGINT, libc::SIGTERM, super::FROM_LAUNCHER] {
            // SAFETY: installs an async-signal-safe handler; replaces an
            // inherited SIG_IGN too, which is the point.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = forward as *const () as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(sig, &action, std::ptr::null_mut());
            }
        }
    }
}
