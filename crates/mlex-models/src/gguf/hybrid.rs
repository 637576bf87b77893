//! GGUF checkpoints of the hybrids: llama.cpp's `qwen3next`, `qwen35`,
//! `qwen35moe`, `nemotron_h` and `nemotron_h_moe`.
//!
//! llama.cpp's converter (`convert_hf_to_gguf.py`, its Qwen3Next, Qwen3.5
//! and NemotronH classes) reshapes these models for its own kernels; this
//! module undoes each step into mlx-lm's sanitized layout, so the
//! architectures in [`crate::models`] load the result unchanged:
//!
//! * Qwen: the norms Hugging Face stores as offsets already carry their +1
//!   (as mlx-lm's sanitized weights do); `ssm_a = -exp(A_log)` becomes
//!   `A_log` again; convs `[C, K]` become `[C, K, 1]`. Qwen3-Next's
//!   `attn_qkv` (all q, all k, all v) and `attn_gate` (z) are exactly
//!   Qwen3.5's `in_proj_qkv` and `in_proj_z`, and `ssm_ba` (per key head
//!   `[b(r), a(r)]`) splits into `in_proj_b` and `in_proj_a`, so such a file
//!   loads with the split projection layout; a file from before llama.cpp
//!   split them (its fused `ssm_in`) loads with the fused one. Qwen3.5's
//!   value heads are stored tiled (slot `j * nk + g` holds head `g * r + j`)
//!   and are put back in grouped order in every tensor that has them,
//!   including the input columns of `ssm_out`. Multi-token-prediction
//!   blocks (`nextn_predict_layers`, `blk.{n_layer + i}` with `nextn.*`)
//!   become the checkpoint's `mtp.*` (norms already carry their +1).
//! * NemotronH: `ssm_a`, `ssm_d` `[heads, 1]` and the grouped norm
//!   `[groups, d_inner / groups]` are flattened, q/k rows leave LLaMA's
//!   rotary interleave, and the per-layer `head_count_kv` and
//!   `feed_forward_length` arrays give back `hybrid_override_pattern`.
//!
//! Row reorders apply to quantized tensors as they are (each row keeps its
//! scales). A column reorder of a quantized `ssm_out` moves whole
//! quantization groups when a head's width is a multiple of the group;
//! otherwise that one tensor is dequantized to float32.

use super::lazy::Tensor;
use super::names::{self, Scheme};
use super::{bad, quantization_config, read_tokenizer, GgufCheckpoint, Meta};
use crate::gguf_file::{GgufHeader, MetaValue, TensorData};
use mlex_core::config::ModelConfig;
use mlex_core::error::Result;
use mlex_core::weights::WeightMap;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// The `general.architecture` of every hybrid family read here.
pub(super) const ARCHITECTURES: &[&str] = &[
    "qwen3next",
    "qwen35",
    "qwen35moe",
    "nemotron_h",
    "nemotron_h_moe",
];

/// The hybrid GGUF architectures, by `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Family {
    Qwen3Next,
    Qwen35,
    Qwen35Moe,
    NemotronH,
    NemotronHMoe,
}

impl Family {
    pub(super) fn of(arch: &str) -> Option<Family> {
        Some(match arch {
            "qwen3next" => Family::Qwen3Next,
            "qwen35" => Family::Qwen35,
            "qwen35moe" => Family::Qwen35Moe,
            "nemotron_h" => Family::NemotronH,
            "nemotron_h_moe" => Family::NemotronHMoe,
            _ => return None,
        })
    }

    fn arch(self) -> &'static str {
        match self {
            Family::Qwen3Next => "qwen3next",
            Family::Qwen35 => "qwen35",
            Family::Qwen35Moe => "qwen35moe",
            Family::NemotronH => "nemotron_h",
            Family::NemotronHMoe => "nemotron_h_moe",
        }
    }

    fn nemotron(self) -> bool {
        matches!(self, Family::NemotronH | Family::NemotronHMoe)
    }
}

/// Row indices that put tiled value heads (slot `j * nk + g`) back in
/// grouped order (head `g * r + j`), `hd` rows per head, after `offset`
/// rows kept in place.
fn untile(offset: i32, nk: i32, r: i32, hd: i32) -> Vec<i32> {
    let mut idx: Vec<i32> = (0..offset).collect();
    for h in 0..nk * r {
        let slot = (h % r) * nk + h / r;
        idx.extend((0..hd).map(|d| offset + slot * hd + d));
    }
    idx
}

/// Row indices undoing llama.cpp's rotary interleave of q/k rows
/// (`LlamaModel.permute`): row `p * hd / 2 + i` of a head came from row
/// `2 * i + p`.
pub(super) fn unpermute(rows: i32, heads: i32) -> Vec<i32> {
    let hd = rows / heads;
    let half = hd / 2;
    (0..rows)
        .map(|row| {
            let (head, within) = (row / hd, row % hd);
            let (p, i) = (within / half, within % half);
            head * hd + 2 * i + p
        })
        .collect()
}

/// Typed metadata reads for one family; errors name the file and key.
struct Keys<'a> {
    meta: &'a Meta<'a>,
    arch: &'static str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn opt(&self, k: &str) -> Result<Option<i64>> {
        self.meta.i64(&self.key(k))
    }

    fn need(&self, k: &str) -> Result<i64> {
        let key = self.key(k);
        let v = self
            .meta
            .i64(&key)?
            .ok_or_else(|| bad(self.meta.path, format!("metadata `{key}` is missing")))?;
        mlex_core::config::count(v)
            .map(i64::from)
            .map_err(|m| bad(self.meta.path, format!("metadata `{key}` {m}")))
    }

    /// `expert_count` and `expert_used_count`, the second at most the first.
    fn experts(&self) -> Result<(i64, i64)> {
        let experts = self.need("expert_count")?;
        let used = self.need("expert_used_count")?;
        if used > experts {
            return Err(bad(
                self.meta.path,
                format!(
                    "metadata `{}` ({used}) exceeds `{}` ({experts})",
                    self.key("expert_used_count"),
                    self.key("expert_count")
                ),
            ));
        }
        Ok((experts, used))
    }

    fn float(&self, k: &str) -> Result<Option<f64>> {
        self.meta.f64(&self.key(k))
    }

    fn flag(&self, k: &str) -> Option<bool> {
        match self.meta.meta.get(&self.key(k)) {
            Some(MetaValue::Bool(b)) => Some(*b),
            Some(v) => v.as_i64().map(|i| i != 0),
            None => None,
        }
    }

    /// A per-layer array, or one value for every layer.
    fn per_layer(&self, k: &str, layers: usize) -> Result<Vec<i64>> {
        let key = self.key(k);
        let v: Vec<i64> = match self.meta.meta.get(&key) {
            Some(MetaValue::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_i64().ok_or_else(|| {
                        bad(
                            self.meta.path,
                            format!("metadata `{key}` holds a non-integer"),
                        )
                    })
                })
                .collect::<Result<_>>()?,
            Some(x) => vec![
                x.as_i64().ok_or_else(|| {
                    bad(
                        self.meta.path,
                        format!("metadata `{key}` is not an integer"),
                    )
                })?;
                layers
            ],
            None => return Err(bad(self.meta.path, format!("metadata `{key}` is missing"))),
        };
        if v.len() != layers || v.iter().any(|&x| x < 0) {
            return Err(bad(
                self.meta.path,
                format!(
                    "metadata `{key}` must hold {layers} non-negative values (one per layer), not {:?}",
                    v
                ),
            ));
        }
        Ok(v)
    }
}

/// Tensors read from the file, by GGUF name.
struct Tensors {
    map: BTreeMap<String, (Tensor, String)>,
}

impl Tensors {
    fn take(&mut self, name: &str) -> Option<(Tensor, String)> {
        self.map.remove(name)
    }
}

/// The output: weights under mlx-lm names and the GGML type each came from.
struct Out {
    weights: WeightMap,
    file: usize,
    types: Vec<(String, String)>,
    quant: BTreeMap<String, (i32, i32)>,
}

impl Out {
    fn put(&mut self, module: &str, t: Tensor, ty: &str, suffix: &str) {
        self.types
            .push((format!("{module}.{suffix}"), ty.to_owned()));
        if let Some(q) = t.put(&mut self.weights, self.file, module, suffix) {
            self.quant.insert(module.to_owned(), q);
        }
    }
}

/// Reads a hybrid GGUF file.
pub(super) fn load(
    path: &Path,
    header: &GgufHeader,
    meta: &Meta,
    family: Family,
) -> Result<GgufCheckpoint> {
    let keys = Keys {
        meta,
        arch: family.arch(),
    };
    let tokenizer = read_tokenizer(meta)?;
    let mut map = BTreeMap::new();
    for t in &header.tensors {
        let tensor = Tensor::open(path, t);
        if tensor.shape().contains(&0) || tensor.shape().is_empty() {
            return Err(bad(
                path,
                format!("tensor `{}` has the empty shape {:?}", t.name, t.shape),
            ));
        }
        map.insert(t.name.clone(), (tensor, t.ty.name().to_owned()));
    }
    // Every block has tensors; a larger count is a corrupt header (and
    // would size per-layer tables by it).
    let blocks = keys.need("block_count")?;
    if blocks as usize > map.len() {
        return Err(bad(
            path,
            format!(
                "metadata `{}` is {blocks}, more than the file's {} tensors",
                keys.key("block_count"),
                map.len()
            ),
        ));
    }
    let mut tensors = Tensors { map };
    let mut weights = WeightMap::new();
    let file_id = weights.add_file(path.to_owned());
    let mut out = Out {
        weights,
        file: file_id,
        types: Vec::new(),
        quant: BTreeMap::new(),
    };
    let config = if family.nemotron() {
        nemotron(path, &keys, family, &mut tensors, &mut out)?
    } else {
        qwen(path, &keys, family, &mut tensors, &mut out)?
    };
    if let Some(name) = tensors.map.keys().next() {
        return Err(bad(
            path,
            format!(
                "tensor `{name}` has no {} equivalent in mlex (unsupported GGUF layout)",
                family.arch()
            ),
        ));
    }
    let mut config = config;
    if let Some(q) = quantization_config(&out.quant) {
        config.insert("quantization".into(), q);
    }
    Ok(GgufCheckpoint {
        config: ModelConfig::new(Value::Object(config), path),
        weights: out.weights,
        tokenizer,
        tensor_types: out.types,
    })
}

/// Moves the global tensors (embedding, final norm, head) to their names
/// under `scheme`, after `prefix`; returns whether the head is tied and the
/// vocabulary size.
fn globals(
    path: &Path,
    tensors: &mut Tensors,
    out: &mut Out,
    scheme: Scheme,
    prefix: &str,
) -> Result<(bool, i32)> {
    let to = |module: &str| {
        format!(
            "{prefix}{}",
            names::global(scheme, module).expect("names.toml has every global")
        )
    };
    let (e, ty) = tensors
        .take("token_embd.weight")
        .ok_or_else(|| bad(path, "tensor `token_embd.weight` is missing"))?;
    let vocab = e.shape()[0];
    out.put(&to("token_embd"), e, &ty, "weight");
    let (n, ty) = tensors
        .take("output_norm.weight")
        .ok_or_else(|| bad(path, "tensor `output_norm.weight` is missing"))?;
    out.put(&to("output_norm"), n, &ty, "weight");
    let tied = match tensors.take("output.weight") {
        Some((h, ty)) => {
            out.put(&to("output"), h, &ty, "weight");
            false
        }
        None => true,
    };
    Ok((tied, vocab))
}

/// Moves block `b`'s tensors that are renamed as they are (the names
/// table's `scheme` column, `.weight` and `.bias`) under `layer`.
fn renamed(tensors: &mut Tensors, out: &mut Out, scheme: Scheme, b: usize, layer: &str) {
    for (from, to) in names::blocks(scheme) {
        for suffix in ["weight", "bias"] {
            if let Some((t, ty)) = tensors.take(&format!("blk.{b}.{from}.{suffix}")) {
                out.put(&format!("{layer}.{to}"), t, &ty, suffix);
            }
        }
    }
}

/// `qwen3next`, `qwen35`, `qwen35moe`.
fn qwen(
    path: &Path,
    k: &Keys,
    family: Family,
    tensors: &mut Tensors,
    out: &mut Out,
) -> Result<Map<String, Value>> {
    let blocks = k.need("block_count")?;
    let mtp = k.opt("nextn_predict_layers")?.unwrap_or(0);
    let layers = blocks - mtp.clamp(0, blocks);
    let hidden = k.need("embedding_length")?;
    let heads = k.need("attention.head_count")?;
    let kv_heads = k.opt("attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = k.need("attention.key_length")?;
    let nk = k.need("ssm.group_count")? as i32;
    let nv = k.need("ssm.time_step_rank")? as i32;
    let dk = k.need("ssm.state_size")? as i32;
    let inner = k.need("ssm.inner_size")? as i32;
    if nv % nk != 0 || inner % nv != 0 {
        return Err(bad(
            path,
            format!(
                "metadata `{}` ({nv} value heads) must be a multiple of `{}` ({nk} key heads), \
                 and `{}` ({inner}) a multiple of the value heads",
                k.key("ssm.time_step_rank"),
                k.key("ssm.group_count"),
                k.key("ssm.inner_size")
            ),
        ));
    }
    let dv = inner / nv;
    let r = nv / nk;
    let interval = k.opt("full_attention_interval")?.unwrap_or(4).max(1);
    let rot = k.opt("rope.dimension_count")?.unwrap_or(head_dim);
    let theta = k.float("rope.freq_base")?.unwrap_or(10_000_000.0);
    let eps = k.float("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6);
    let context = k.opt("context_length")?;
    let prefix = if family == Family::Qwen3Next {
        ""
    } else {
        "language_model."
    };
    let (tied, vocab) = globals(path, tensors, out, Scheme::Llama, prefix)?;
    let tiled = family != Family::Qwen3Next && nk != nv;
    let attention_bias = tensors.map.keys().any(|n| n.ends_with(".attn_q.bias"));
    let mut fused = false;
    let mut dense_layers = Vec::new();
    for i in 0..blocks {
        let b = |n: &str| format!("blk.{i}.{n}");
        let l = if i < layers {
            format!("{prefix}model.layers.{i}")
        } else {
            // A multi-token-prediction block (llama.cpp keeps it after the
            // trunk, its head's tensors as `nextn.*`): the `mtp.*` of the
            // Hugging Face checkpoint, loaded with --mtp.
            let m = format!("{prefix}mtp");
            for (from, to) in names::nextn() {
                if let Some((t, ty)) = tensors.take(&b(&format!("{from}.weight"))) {
                    out.put(&format!("{m}.{to}"), t, &ty, "weight");
                }
            }
            // Copies of the trunk's embedding and head, where a file has them.
            let own = format!("blk.{i}.nextn.");
            tensors.map.retain(|n, _| !n.starts_with(&own));
            format!("{m}.layers.{}", i - layers)
        };
        renamed(tensors, out, Scheme::Llama, i as usize, &l);
        if i < layers && !out.weights.contains(&format!("{l}.mlp.gate.weight")) {
            dense_layers.push(i);
        }
        if let Some((t, ty)) = tensors.take(&b("ffn_gate_up_exps.weight")) {
            // Fused gate and up experts `[E, 2F, H]`, gate first.
            let shape = t.shape();
            let rows = shape[shape.len().saturating_sub(2)];
            let half = rows / 2;
            let gate: Vec<i32> = (0..half).collect();
            let up: Vec<i32> = (half..rows).collect();
            out.put(
                &format!("{l}.mlp.switch_mlp.gate_proj"),
                t.rows(&gate, false, &b("ffn_gate_up_exps.weight"), path)?,
                &ty,
                "weight",
            );
            out.put(
                &format!("{l}.mlp.switch_mlp.up_proj"),
                t.rows(&up, false, &b("ffn_gate_up_exps.weight"), path)?,
                &ty,
                "weight",
            );
        }
        if let Some((t, ty)) = tensors.take(&b("ffn_gate_inp_shexp.weight")) {
            // A 1-D gate (some converters) is the `[1, H]` linear it is.
            let t = match t.shape().len() {
                1 => match t.ready()? {
                    TensorData::Dense(a) => Tensor::Ready(TensorData::Dense(a.reshape(&[1, -1])?)),
                    other => Tensor::Ready(other),
                },
                _ => t,
            };
            out.put(&format!("{l}.mlp.shared_expert_gate"), t, &ty, "weight");
        }
        // Gated DeltaNet.
        let la = format!("{l}.linear_attn");
        let qk_rows = 2 * nk * dk;
        let heads_idx = |hd: i32| untile(0, nk, r, hd);
        if let Some((t, ty)) = tensors.take(&b("ssm_in.weight")) {
            // Before llama.cpp split it: Hugging Face's fused in_proj_qkvz.
            fused = true;
            out.put(&format!("{la}.in_proj_qkvz"), t, &ty, "weight");
        }
        if let Some((t, ty)) = tensors.take(&b("attn_qkv.weight")) {
            let t = if tiled {
                t.rows(
                    &untile(qk_rows, nk, r, dv),
                    true,
                    &b("attn_qkv.weight"),
                    path,
                )?
            } else {
                t
            };
            out.put(&format!("{la}.in_proj_qkv"), t, &ty, "weight");
        }
        if let Some((t, ty)) = tensors.take(&b("attn_gate.weight")) {
            let t = if tiled {
                t.rows(&heads_idx(dv), true, &b("attn_gate.weight"), path)?
            } else {
                t
            };
            out.put(&format!("{la}.in_proj_z"), t, &ty, "weight");
        }
        for (from, to) in [
            ("ssm_beta.weight", "in_proj_b"),
            ("ssm_alpha.weight", "in_proj_a"),
        ] {
            if let Some((t, ty)) = tensors.take(&b(from)) {
                let t = if tiled {
                    t.rows(&heads_idx(1), true, &b(from), path)?
                } else {
                    t
                };
                out.put(&format!("{la}.{to}"), t, &ty, "weight");
            }
        }
        if let Some((t, ty)) = tensors.take(&b("ssm_ba.weight")) {
            if fused {
                out.put(&format!("{la}.in_proj_ba"), t, &ty, "weight");
            } else {
                // Per key head g: rows [b (r), a (r)].
                let pick = |second: i32| -> Vec<i32> {
                    (0..nk)
                        .flat_map(|g| (0..r).map(move |j| g * 2 * r + second * r + j))
                        .collect()
                };
                let n = &b("ssm_ba.weight");
                let rows = t.shape()[0];
                if rows != 2 * nv {
                    return Err(bad(
                        path,
                        format!(
                            "tensor `{n}` has {rows} rows; the metadata's {nv} value heads need {}",
                            2 * nv
                        ),
                    ));
                }
                out.put(
                    &format!("{la}.in_proj_b"),
                    t.rows(&pick(0), false, n, path)?,
                    &ty,
                    "weight",
                );
                out.put(
                    &format!("{la}.in_proj_a"),
                    t.rows(&pick(1), false, n, path)?,
                    &ty,
                    "weight",
                );
            }
        }
        if let Some((t, ty)) = tensors.take(&b("ssm_conv1d.weight")) {
            let t = if tiled {
                t.rows(
                    &untile(qk_rows, nk, r, dv),
                    true,
                    &b("ssm_conv1d.weight"),
                    path,
                )?
            } else {
                t
            };
            out.put(
                &format!("{la}.conv1d"),
                t.map(|a| Ok(a.expand_dims(-1)?))?,
                &ty,
                "weight",
            );
        }
        if let Some((t, ty)) = tensors.take(&b("ssm_dt.bias")) {
            let t = if tiled {
                t.rows(&heads_idx(1), true, &b("ssm_dt.bias"), path)?
            } else {
                t
            };
            out.weights
                .insert(format!("{la}.dt_bias"), t.dense()?, out.file);
            out.types.push((format!("{la}.dt_bias"), ty));
        }
        if let Some((t, ty)) = tensors.take(&b("ssm_a")) {
            let t = if tiled {
                t.rows(&heads_idx(1), true, &b("ssm_a"), path)?
            } else {
                t
            };
            let a_log = t.dense()?.reshape(&[-1])?.negative()?.log()?;
            out.weights.insert(format!("{la}.A_log"), a_log, out.file);
            out.types.push((format!("{la}.A_log"), ty));
        }
        if let Some((t, ty)) = tensors.take(&b("ssm_out.weight")) {
            let t = if tiled {
                let perm: Vec<i32> = (0..nv).map(|h| (h % r) * nk + h / r).collect();
                t.column_blocks(&perm, dv, &b("ssm_out.weight"), path)?
            } else {
                t
            };
            out.put(&format!("{la}.out_proj"), t, &ty, "weight");
        }
    }
    let moe = family != Family::Qwen35;
    let experts = if moe {
        k.opt("expert_count")?.unwrap_or(0)
    } else {
        0
    };
    let mut c = Map::new();
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert(
        "intermediate_size".into(),
        json!(k.opt("feed_forward_length")?.unwrap_or(0)),
    );
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("num_key_value_heads".into(), json!(kv_heads));
    c.insert("head_dim".into(), json!(head_dim));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("rms_norm_eps".into(), json!(eps));
    if let Some(ctx) = context {
        c.insert("max_position_embeddings".into(), json!(ctx));
    }
    c.insert("linear_num_key_heads".into(), json!(nk));
    c.insert("linear_num_value_heads".into(), json!(nv));
    c.insert("linear_key_head_dim".into(), json!(dk));
    c.insert("linear_value_head_dim".into(), json!(dv));
    c.insert(
        "linear_conv_kernel_dim".into(),
        json!(k.need("ssm.conv_kernel")?),
    );
    c.insert("full_attention_interval".into(), json!(interval));
    c.insert("tie_word_embeddings".into(), json!(tied));
    let mtp_layers = blocks - layers;
    c.insert(
        if family == Family::Qwen3Next {
            "num_nextn_predict_layers"
        } else {
            "mtp_num_hidden_layers"
        }
        .into(),
        json!(mtp_layers),
    );
    c.insert("attention_bias".into(), json!(attention_bias));
    if experts > 0 {
        let (_, used) = k.experts()?;
        c.insert("num_experts".into(), json!(experts));
        c.insert("num_experts_per_tok".into(), json!(used));
        c.insert(
            "moe_intermediate_size".into(),
            json!(k.need("expert_feed_forward_length")?),
        );
        c.insert(
            "shared_expert_intermediate_size".into(),
            json!(k.opt("expert_shared_feed_forward_length")?.unwrap_or(0)),
        );
        // llama.cpp renormalizes the top-k weights of these models always.
        c.insert("norm_topk_prob".into(), json!(true));
    }
    let partial = rot as f64 / head_dim as f64;
    if family == Family::Qwen3Next {
        c.insert("model_type".into(), json!("qwen3_next"));
        c.insert("rope_theta".into(), json!(theta));
        c.insert("partial_rotary_factor".into(), json!(partial));
        c.insert("decoder_sparse_step".into(), json!(1));
        c.insert("mlp_only_layers".into(), json!(dense_layers));
        if experts == 0 {
            c.insert("num_experts".into(), json!(0));
        }
        if !fused {
            c.insert("linear_attention_projections".into(), json!("split"));
        }
        return Ok(c);
    }
    let sections: Vec<i32> = k
        .meta
        .ints(&k.key("rope.dimension_sections"))?
        .into_iter()
        .take(3)
        .collect();
    let mut rope = Map::new();
    rope.insert("type".into(), json!("default"));
    if !sections.is_empty() {
        rope.insert("mrope_section".into(), json!(sections));
    }
    rope.insert("rope_theta".into(), json!(theta));
    rope.insert("partial_rotary_factor".into(), json!(partial));
    c.insert("rope_parameters".into(), Value::Object(rope));
    let (outer, inner_type) = if family == Family::Qwen35Moe {
        ("qwen3_5_moe", "qwen3_5_moe_text")
    } else {
        ("qwen3_5", "qwen3_5_text")
    };
    c.insert("model_type".into(), json!(inner_type));
    let mut top = Map::new();
    top.insert("model_type".into(), json!(outer));
    top.insert("tie_word_embeddings".into(), json!(tied));
    top.insert("text_config".into(), Value::Object(c));
    Ok(top)
}

/// `nemotron_h`, `nemotron_h_moe`.
fn nemotron(
    path: &Path,
    k: &Keys,
    family: Family,
    tensors: &mut Tensors,
    out: &mut Out,
) -> Result<Map<String, Value>> {
    let layers = k.need("block_count")? as usize;
    let hidden = k.need("embedding_length")?;
    let heads = k.need("attention.head_count")?;
    let kv = k.per_layer("attention.head_count_kv", layers)?;
    let ff = k.per_layer("feed_forward_length", layers)?;
    let moe = family == Family::NemotronHMoe;
    let pattern: String = kv
        .iter()
        .zip(&ff)
        .map(|(&kv, &ff)| match (kv, ff) {
            (0, 0) => 'M',
            (_, 0) => '*',
            _ if moe => 'E',
            _ => '-',
        })
        .collect();
    let kv_heads = kv.iter().copied().max().unwrap_or(0).max(1);
    let head_dim = k.opt("attention.key_length")?.unwrap_or(hidden / heads);
    let mamba_heads = k.need("ssm.time_step_rank")?;
    let inner = k.need("ssm.inner_size")?;
    let groups = k.need("ssm.group_count")?;
    if inner % mamba_heads != 0 || inner % groups != 0 {
        return Err(bad(
            path,
            format!(
                "metadata `{}` ({inner}) must be a multiple of `{}` ({mamba_heads}) and of `{}` ({groups})",
                k.key("ssm.inner_size"),
                k.key("ssm.time_step_rank"),
                k.key("ssm.group_count")
            ),
        ));
    }
    let eps = match k.float("attention.layer_norm_rms_epsilon")? {
        Some(e) => e,
        None => k.float("attention.layer_norm_epsilon")?.unwrap_or(1e-5),
    };
    let (tied, vocab) = globals(path, tensors, out, Scheme::NemotronH, "")?;
    let has = |tensors: &Tensors, n: &str| {
        (0..layers).any(|i| tensors.map.contains_key(&format!("blk.{i}.{n}")))
    };
    let conv_bias = has(tensors, "ssm_conv1d.bias");
    let proj_bias = has(tensors, "ssm_in.bias");
    let attn_bias = has(tensors, "attn_q.bias");
    let mlp_bias = has(tensors, "ffn_up.bias");
    if has(tensors, "ffn_latent_down.weight") {
        return Err(bad(
            path,
            "tensor `ffn_latent_down` (Nemotron 3 Super's latent MoE) is not supported by mlex's nemotron_h",
        ));
    }
    for (i, &kv_i) in kv.iter().enumerate() {
        let b = |n: &str| format!("blk.{i}.{n}");
        let l = format!("backbone.layers.{i}");
        // q/k rows leave llama.cpp's rotary interleave first.
        for (from, h) in [("attn_q", heads), ("attn_k", kv_i)] {
            for suffix in ["weight", "bias"] {
                let name = b(&format!("{from}.{suffix}"));
                if let Some((t, ty)) = tensors.take(&name) {
                    let rows = t.shape()[0];
                    if h <= 0 || rows as i64 % (2 * h) != 0 {
                        return Err(bad(
                            path,
                            format!(
                                "tensor `{name}`: {rows} rows do not split into {h} heads of pairs"
                            ),
                        ));
                    }
                    let to = names::block(Scheme::NemotronH, from).expect("names.toml has q and k");
                    out.put(
                        &format!("{l}.{to}"),
                        t.rows(&unpermute(rows, h as i32), true, &name, path)?,
                        &ty,
                        suffix,
                    );
                }
            }
        }
        if let Some((t, ty)) = tensors.take(&b("ssm_conv1d.weight")) {
            let to =
                names::block(Scheme::NemotronH, "ssm_conv1d").expect("names.toml has the conv");
            out.put(
                &format!("{l}.{to}"),
                t.map(|a| Ok(a.expand_dims(-1)?))?,
                &ty,
                "weight",
            );
        }
        renamed(tensors, out, Scheme::NemotronH, i, &l);
        let flat =
            |name: &str, to: &str, out: &mut Out, tensors: &mut Tensors, log: bool| -> Result<()> {
                if let Some((t, ty)) = tensors.take(&b(name)) {
                    let mut a = t.dense()?.reshape(&[-1])?;
                    if log {
                        a = a.negative()?.log()?;
                    }
                    out.weights.insert(format!("{l}.{to}"), a, out.file);
                    out.types.push((format!("{l}.{to}"), ty));
                }
                Ok(())
            };
        flat("ssm_a", "mixer.A_log", out, tensors, true)?;
        flat("ssm_d", "mixer.D", out, tensors, false)?;
        flat("ssm_dt.bias", "mixer.dt_bias", out, tensors, false)?;
        flat("ssm_norm.weight", "mixer.norm.weight", out, tensors, false)?;
        flat(
            "exp_probs_b.bias",
            "mixer.gate.e_score_correction_bias",
            out,
            tensors,
            false,
        )?;
    }
    let mut c = Map::new();
    c.insert("model_type".into(), json!("nemotron_h"));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert("hybrid_override_pattern".into(), json!(pattern));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("num_key_value_heads".into(), json!(kv_heads));
    c.insert("head_dim".into(), json!(head_dim));
    c.insert("attention_bias".into(), json!(attn_bias));
    c.insert("mamba_num_heads".into(), json!(mamba_heads));
    c.insert("mamba_head_dim".into(), json!(inner / mamba_heads));
    c.insert("mamba_proj_bias".into(), json!(proj_bias));
    c.insert("use_bias".into(), json!(proj_bias));
    c.insert("ssm_state_size".into(), json!(k.need("ssm.state_size")?));
    c.insert("conv_kernel".into(), json!(k.need("ssm.conv_kernel")?));
    c.insert("n_groups".into(), json!(groups));
    c.insert("use_conv_bias".into(), json!(conv_bias));
    c.insert("mlp_bias".into(), json!(mlp_bias));
    c.insert("layer_norm_epsilon".into(), json!(eps));
    c.insert("tie_word_embeddings".into(), json!(tied));
    let dense_ff = ff.iter().copied().max().unwrap_or(0);
    c.insert("intermediate_size".into(), json!(dense_ff));
    // llama.cpp writes 2^20 here whatever the model was trained for; it is
    // kept as the context limit (the model has no positional encoding).
    if let Some(ctx) = k.opt("context_length")? {
        c.insert("max_position_embeddings".into(), json!(ctx));
    }
    if moe {
        let (experts, used) = k.experts()?;
        c.insert("n_routed_experts".into(), json!(experts));
        c.insert("num_experts_per_tok".into(), json!(used));
        c.insert(
            "moe_intermediate_size".into(),
            json!(k.need("expert_feed_forward_length")?),
        );
        c.insert(
            "moe_shared_expert_intermediate_size".into(),
            json!(k.opt("expert_shared_feed_forward_length")?.unwrap_or(0)),
        );
        c.insert(
            "n_shared_experts".into(),
            json!(k.opt("expert_shared_count")?.unwrap_or(1)),
        );
        c.insert(
            "norm_topk_prob".into(),
            json!(k.flag("expert_weights_norm").unwrap_or(false)),
        );
        c.insert(
            "routed_scaling_factor".into(),
            json!(k.float("expert_weights_scale")?.unwrap_or(1.0)),
        );
        c.insert(
            "n_group".into(),
            json!(k.opt("expert_group_count")?.unwrap_or(1)),
        );
        c.insert(
            "topk_group".into(),
            json!(k.opt("expert_group_used_count")?.unwrap_or(1)),
        );
    }
    Ok(c)
}
