//! Parity with the references on every fixture: mlx-lm (every `model_type`
//! but `dhara_ar`) and the independent NumPy implementation (`dhara_ar`).
//!
//! For each fixture: full-forward logits within the dtype's tolerance,
//! 32 greedy tokens identical, and incremental decode (prompt in one pass
//! and in chunks) equal to the full forward.

use mlex_models::load::load;
use mlex_testkit::*;
use mlx_rs::ops::indexing::TryIndexOp;

/// Relative per-step tolerance of incremental vs full forward below float32.
const LOW_PRECISION_SELF_TOL: f32 = 0.06;

fn check(f: &Fixture) -> Result<String, String> {
    // A fixture of a model_type no built-in serves brings its spec file,
    // as a user would with --arch-dir.
    let registry = mlex_models::build_registry(&f.arch_paths()).map_err(|e| e.to_string())?;
    let path = path_of(f);
    let loaded = load(path.to_str().unwrap(), &registry).map_err(|e| format!("load: {e}"))?;
    let model = &loaded.model;
    let r = reference(f);
    let tol = tolerance(f);

    // 1. Full forward (no earlier state) against the reference.
    let mut cache = model.make_cache(1).map_err(|e| e.to_string())?;
    let full = model
        .forward(&tokens(&r.prompt), &mut cache)
        .map_err(|e| e.to_string())?;
    let (d, m) = max_diff(&to_f32(&full), &to_f32(&r.logits_full));
    if d > tol * m.max(1.0) {
        return Err(format!(
            "full-forward logits differ by {d} (max |logit| {m}, tolerance {tol})"
        ));
    }

    // 2. Greedy tokens with the cache, prompt in one pass.
    let (toks, rows) = greedy(model, &r.prompt, r.greedy.len(), None);
    if toks != r.greedy {
        let first = toks
            .iter()
            .zip(&r.greedy)
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        return Err(format!(
            "greedy tokens differ from step {first}: got {:?}, want {:?}",
            &toks[first..(first + 4).min(toks.len())],
            &r.greedy[first..(first + 4).min(r.greedy.len())]
        ));
    }
    let step_ref = to_f32(&r.step_logits);
    let v = rows[0].len();
    let mut worst = 0f32;
    for (i, row) in rows.iter().enumerate() {
        let (d, m) = max_diff(row, &step_ref[i * v..(i + 1) * v]);
        worst = worst.max(d / m.max(1.0));
    }
    if worst > tol * 4.0 {
        return Err(format!(
            "decode-step logits differ by {worst} relative (tolerance {})",
            tol * 4.0
        ));
    }

    // 3. Incremental decode equals the full forward: logits of the full
    //    sequence vs the logits each cached step produced.
    let mut seq = r.prompt.clone();
    seq.extend(&toks[..toks.len() - 1]);
    let mut cache = model.make_cache(1).map_err(|e| e.to_string())?;
    let full = model
        .forward(&tokens(&seq), &mut cache)
        .map_err(|e| e.to_string())?;
    let p = r.prompt.len() as i32;
    let tail = full
        .try_index((0, (p - 1)..(seq.len() as i32), ..))
        .map_err(|e| e.to_string())?;
    let tail = to_f32(&tail);
    let mut worst = 0f32;
    let mut per_step = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let (d, m) = max_diff(row, &tail[i * v..(i + 1) * v]);
        per_step.push(d / m.max(1.0));
        worst = worst.max(d / m.max(1.0));
    }
    if std::env::var_os("MLEX_DEBUG").is_some() {
        eprintln!("{}: incremental vs full per step {per_step:?}", f.name);
    }
    if f.dtype == "float32" && f.quant.is_none() {
        // The exact invariant: in float32 both orders of computation agree.
        if worst > 1e-4 {
            return Err(format!(
                "incremental decode differs from the full forward by {worst} (tolerance 1e-4)"
            ));
        }
    } else {
        // In low precision the two orders round differently (mlx-lm's own
        // NemotronH bf16 differs by up to 0.42 between them), and a MoE
        // router near-tie can flip one expert at an isolated step; require
        // 90% of the steps within the tolerance.
        per_step.sort_by(f32::total_cmp);
        let p90 = per_step[per_step.len() * 9 / 10];
        if p90 > LOW_PRECISION_SELF_TOL {
            return Err(format!(
                "incremental decode differs from the full forward by {p90} at the 90th percentile (tolerance {LOW_PRECISION_SELF_TOL})"
            ));
        }
    }

    // 4. Prompt in chunks: the same logits after the prompt and, in float32,
    //    the same tokens.
    let exact = f.dtype == "float32" && f.quant.is_none();
    for chunk in [1usize, 5] {
        let mut c = model.make_cache(1).map_err(|e| e.to_string())?;
        let chunked = to_f32(&prefill(model, &mut c, &r.prompt, Some(chunk)));
        let (d, m) = max_diff(&chunked, &rows[0]);
        let limit = if exact { 1e-4 } else { LOW_PRECISION_SELF_TOL };
        if d / m.max(1.0) > limit {
            return Err(format!(
                "prefill in chunks of {chunk} changes the logits by {d} (tolerance {limit})"
            ));
        }
        if exact {
            let (ct, _) = greedy(model, &r.prompt, 8, Some(chunk));
            if ct[..] != toks[..8] {
                return Err(format!(
                    "prefill in chunks of {chunk} changes the tokens: {ct:?} vs {:?}",
                    &toks[..8]
                ));
            }
        }
    }
    Ok(format!("ok (logit diff {d:.2e}, tol {tol})"))
}

#[test]
fn every_fixture_matches_its_reference() {
    let all = fixtures();
    let only = std::env::var("MLEX_ONLY").ok();
    let mut failures = Vec::new();
    let mut checked = 0;
    for f in all.iter().filter(|f| {
        only.as_ref()
            .is_none_or(|o| o.split(',').any(|n| n == f.name))
    }) {
        match check(f) {
            Ok(msg) => eprintln!("{:<24} {msg}", f.name),
            Err(e) => {
                eprintln!("{:<24} FAILED: {e}", f.name);
                failures.push(format!("{}: {e}", f.name));
            }
        }
        checked += 1;
    }
    assert!(checked > 0, "no fixture was checked");
    assert!(
        failures.is_empty(),
        "{} of {checked} fixtures failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
