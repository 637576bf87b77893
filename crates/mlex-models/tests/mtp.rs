//! Multi-token-prediction heads against a reference nobody here wrote:
//! mlx-lm's own decoder layer composed as vLLM and llama.cpp run the head
//! (`xtask/py/mtp_ref.py`), on Hugging Face checkpoints of Qwen3-Next and
//! Qwen3.5 with a whole random MTP block, and on a Qwen3.5 GGUF that holds
//! one as llama.cpp's converter writes it (`blk.L`, `nextn.*`).

use mlex_models::load::load_with_mtp;
use mlex_testkit::*;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use std::collections::HashMap;

fn close(name: &str, got: &Array, want: &Array) {
    let (d, scale) = max_diff(&to_f32(got), &to_f32(want));
    assert!(
        d <= 1e-4 * scale.max(1.0),
        "{name}: differs by {d} (largest {scale})"
    );
}

#[test]
fn mtp_heads_match_the_composed_reference() {
    let registry = mlex_models::registry().unwrap();
    let dispatch = mlex_models::dispatch().unwrap();
    let with = fixtures_where(|f| f.mtp_reference.is_some());
    assert_eq!(
        with.len(),
        3,
        "qwen3_next-mtp-hf, qwen3_5-mtp-hf and gguf-qwen3_5-mtp-f32"
    );
    for f in with {
        let path = path_of(&f);
        let model = load_with_mtp(path.to_str().unwrap(), registry, &dispatch, true)
            .unwrap()
            .model;
        let head = model
            .mtp
            .as_ref()
            .unwrap_or_else(|| panic!("{}: no head", f.name));
        let r: HashMap<String, Array> =
            Array::load_safetensors(fixtures_dir().join(f.mtp_reference.as_ref().unwrap()))
                .unwrap();
        let prompt: Vec<i32> = {
            let a = r["prompt"].as_dtype(Dtype::Int32).unwrap();
            a.eval().unwrap();
            a.as_slice::<i32>().to_vec()
        };
        let p = prompt.len() as i32;
        let tokens = tokens(&prompt);
        let mut cache = model.make_cache(1).unwrap();
        let x = model.forward_hidden(&tokens, &mut cache).unwrap();
        let (_, normed) = model
            .output
            .forward_with_normed(&model.params.view(), &x)
            .unwrap();
        let mut caches = head.make_caches(&model, 1).unwrap();
        let rows_h = normed.try_index((.., ..p - 1, ..)).unwrap();
        let rows_t = tokens.try_index((.., 1..)).unwrap();
        let (logits, out) = model.mtp_rows(&rows_h, &rows_t, &mut caches).unwrap();
        close(&f.name, &logits.try_index(0).unwrap(), &r["mtp_logits"]);
        // One chained draft: the last row's own state and its argmax.
        let last = logits.try_index((0, p - 2)).unwrap();
        let top = mlx_rs::ops::indexing::argmax_axis(&last, -1, None).unwrap();
        let chain = r["chain_token"].as_dtype(Dtype::Int32).unwrap();
        assert_eq!(
            to_f32(&top),
            to_f32(&chain),
            "{}: the chained token",
            f.name
        );
        let (logits2, _) = model
            .mtp_rows(
                &out.try_index((.., p - 2.., ..)).unwrap(),
                &chain.reshape(&[1, 1]).unwrap(),
                &mut caches,
            )
            .unwrap();
        close(
            &format!("{} chained", f.name),
            &logits2.try_index((0, 0)).unwrap(),
            &r["chain_logits"],
        );
    }
}

#[test]
fn mtp_asked_of_a_checkpoint_without_one_names_the_option_and_the_file() {
    let registry = mlex_models::registry().unwrap();
    let dispatch = mlex_models::dispatch().unwrap();
    for name in ["qwen3_5-f32", "qwen3_next-f32", "llama-f32"] {
        let path = path_of(&fixture(name));
        let e = load_with_mtp(path.to_str().unwrap(), registry, &dispatch, true)
            .err()
            .unwrap_or_else(|| panic!("{name}: loaded a head it does not have"))
            .to_string();
        assert!(e.contains("--mtp"), "{name}: {e}");
        assert!(e.contains("config.json"), "{name}: {e}");
        // Without --mtp the same checkpoints load, the head left out.
        let m = load_with_mtp(path.to_str().unwrap(), registry, &dispatch, false).unwrap();
        assert!(m.model.mtp.is_none());
    }
}

#[test]
fn mtp_asked_of_a_gguf_without_the_block_names_the_option_and_the_file() {
    let registry = mlex_models::registry().unwrap();
    let dispatch = mlex_models::dispatch().unwrap();
    let path = path_of(&fixture("gguf-qwen3_5-f32"));
    let e = load_with_mtp(path.to_str().unwrap(), registry, &dispatch, true)
        .err()
        .expect("a GGUF without blk.N.nextn.* gave a head")
        .to_string();
    assert_mentions(&e, &["--mtp", "model.gguf"]);
    // The file that has the block loads it only when asked.
    let with = path_of(&fixture("gguf-qwen3_5-mtp-f32"));
    let m = load_with_mtp(with.to_str().unwrap(), registry, &dispatch, false).unwrap();
    assert!(m.model.mtp.is_none());
}
