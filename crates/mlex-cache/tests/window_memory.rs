//! A conv window taken after a prompt owns its buffer: keeping it (in a
//! cache or a prompt-cache snapshot) must not keep the prompt's padded
//! input alive. Its own test binary, since MLX's active-memory count is
//! process-wide.

use mlex_cache::conv_window_step;
use mlx_rs::{ops, Dtype};

#[test]
fn a_window_after_a_prompt_does_not_hold_the_padded_prompt() {
    // Small widths: MLX lets a contiguous slice share a parent buffer that
    // is at most 16 KB larger, which is where a view would stay behind.
    let (keep, channels, len) = (3, 16, 64);
    let window = ops::zeros_dtype(&[1, keep, channels], Dtype::Float32).unwrap();
    let x = ops::ones_dtype(&[1, len, channels], Dtype::Float32).unwrap();
    x.eval().unwrap();
    let before = mlx_rs::memory::active_memory().unwrap();
    let (padded, next) = conv_window_step(&window, &x).unwrap();
    next.eval().unwrap();
    assert_eq!(next.shape(), &[1, keep, channels]);
    // The window is the last `keep` rows of the prompt.
    assert!(next
        .try_as_slice::<f32>()
        .unwrap()
        .iter()
        .all(|&v| v == 1.0));
    drop(padded);
    drop(x);
    let after = mlx_rs::memory::active_memory().unwrap();
    let (x_bytes, window_bytes) = (
        (len * channels * 4) as usize,
        (keep * channels * 4) as usize,
    );
    // What stays is the window: 192 bytes, not the 4,288-byte padded input.
    assert!(
        after + x_bytes <= before + window_bytes + 256,
        "active {before} -> {after}; window {window_bytes}, prompt {x_bytes}"
    );
}
