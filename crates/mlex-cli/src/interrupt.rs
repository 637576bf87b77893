//! SIGINT as well-kept Unix tools handle it: the first Ctrl-C during
//! generation stops it after the current token (the text so far and the
//! summary line are still printed, and the process exits 130); a second one,
//! or one while nothing is generating, exits 130 at once.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static COUNT: AtomicUsize = AtomicUsize::new(0);
static GENERATING: AtomicBool = AtomicBool::new(false);

/// Installs the handler (once per process; later calls do nothing).
fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // If no handler can be installed, SIGINT keeps its default action.
        let _ = ctrlc::set_handler(|| {
            let earlier = COUNT.fetch_add(1, Ordering::SeqCst);
            if earlier > 0 || !GENERATING.load(Ordering::SeqCst) {
                std::process::exit(130);
            }
        });
    });
}

/// Marks generation as running (`true`) or finished; a finished generation
/// forgets an interrupt it has already acted on only through [`reset`].
fn set_generating(on: bool) {
    GENERATING.store(on, Ordering::SeqCst);
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
    install();
    set_generating(true);
    let out = generate();
    set_generating(false);
    (out, requested())
}
