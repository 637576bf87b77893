//! The tensors llama.cpp stores reordered, split or transformed, as a
//! spec's `[gguf.tensors]` declares them ([`TensorRule`]), and the
//! reorders that undo its converter (`convert_hf_to_gguf.py`: its
//! `LlamaModel.permute`, Qwen3.5's `_LinearAttentionVReorderBase`, the
//! Gated DeltaNet and Mamba2 reshapes).
//!
//! Row reorders apply to quantized tensors as they are (each row keeps its
//! scales). A column reorder of a quantized tensor moves whole
//! quantization groups when a head's width is a multiple of the group;
//! otherwise that one tensor is dequantized to float32.

use super::lazy::Tensor;
use super::{bad, Out};
use crate::gguf_file::TensorData;
use mlex_core::error::Result;
use mlx_rs::Array;
use serde::Deserialize;
use std::path::Path;

/// One tensor of a block (`[gguf.tensors]`, by its name after `blk.N.`):
/// where it goes under its layer and what is undone on the way.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TensorRule {
    /// Its name under the layer (`linear_attn.in_proj_qkv.weight`).
    pub to: Option<String>,
    /// What is done to its values.
    pub how: How,
    /// Which of its rows or columns are value heads, stored tiled when the
    /// spec says so (`tiled_value_heads`).
    pub value_heads: Option<ValueHeads>,
    /// How its rows split into the tensors `into` names.
    pub split: Option<Split>,
    /// The names the split gives, in order (as `to`).
    pub into: Vec<String>,
    /// Taken whole, to `to`, instead of split when some block has this
    /// tensor (a file from before llama.cpp split a fused projection).
    pub whole_if: Option<String>,
}

/// A value transform.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum How {
    /// As it is (quantized tensors stay quantized).
    #[default]
    Keep,
    /// A squeezed convolution `[C, K]` back to MLX's `[C, K, 1]`.
    Conv,
    /// Float32, flattened (`[heads, 1]` and grouped norms `[groups, n]`).
    Flatten,
    /// `ssm_a = -exp(A_log)` back to `A_log`, flattened.
    ALog,
    /// A vector back to the one-row matrix it is (`[1, n]`).
    Row,
}

/// The value heads in a tensor's rows or columns.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ValueHeads {
    /// Rows: all q, all k (left in place), then v by value head.
    QkvRows,
    /// Rows: one block of the value width a head.
    Rows,
    /// Rows: one a head.
    Scalars,
    /// Input columns: one block of the value width a head.
    Columns,
}

/// How a tensor's rows split in two.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// The first half and the second (fused gate and up experts
    /// `[E, 2F, H]`, gate first).
    Halves,
    /// Per key head `g`, its value heads' rows of the first tensor then of
    /// the second (`ssm_ba`: `[b (r), a (r)]`).
    PerKeyHead,
}

/// The Gated DeltaNet head layout (the config's `linear_num_key_heads`,
/// `linear_num_value_heads`, `linear_key_head_dim`,
/// `linear_value_head_dim`) and whether the file tiles the value heads.
#[derive(Clone, Copy, Debug)]
pub(super) struct Heads {
    pub nk: i32,
    pub nv: i32,
    pub dk: i32,
    pub dv: i32,
    pub tiled: bool,
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

/// Where a rule's tensor is: the file, its GGUF name, its layer's name.
pub(super) struct At<'a> {
    pub path: &'a Path,
    pub name: &'a str,
    pub layer: &'a str,
}

impl TensorRule {
    /// Undoes what llama.cpp did to tensor `t` (GGML type `ty`) and puts
    /// the result under `at.layer`; `whole`: the file has the rule's
    /// `whole_if` tensor.
    pub(super) fn apply(
        &self,
        t: Tensor,
        ty: &str,
        at: &At,
        heads: Option<Heads>,
        whole: bool,
        out: &mut Out,
    ) -> Result<()> {
        let (path, name) = (at.path, at.name);
        let need_heads = || {
            heads.ok_or_else(|| {
                bad(
                    path,
                    format!("tensor `{name}` needs the linear-attention heads in the metadata"),
                )
            })
        };
        let t = match self.value_heads {
            Some(v) if need_heads()?.tiled => {
                let h = need_heads()?;
                let r = h.nv / h.nk;
                match v {
                    ValueHeads::QkvRows => {
                        t.rows(&untile(2 * h.nk * h.dk, h.nk, r, h.dv), true, name, path)?
                    }
                    ValueHeads::Rows => t.rows(&untile(0, h.nk, r, h.dv), true, name, path)?,
                    ValueHeads::Scalars => t.rows(&untile(0, h.nk, r, 1), true, name, path)?,
                    ValueHeads::Columns => {
                        let perm: Vec<i32> = (0..h.nv).map(|i| (i % r) * h.nk + i / r).collect();
                        t.column_blocks(&perm, h.dv, name, path)?
                    }
                }
            }
            _ => t,
        };
        if let Some(split) = self.split.filter(|_| !whole) {
            let [first, second] = self.into.as_slice() else {
                return Err(bad(
                    path,
                    format!("gguf tensor rule of `{name}`: `into` needs two names"),
                ));
            };
            let (a, b) = match split {
                Split::Halves => {
                    let shape = t.shape();
                    let rows = shape[shape.len().saturating_sub(2)];
                    let half = rows / 2;
                    ((0..half).collect::<Vec<i32>>(), (half..rows).collect())
                }
                Split::PerKeyHead => {
                    let h = need_heads()?;
                    let (nk, r) = (h.nk, h.nv / h.nk);
                    let rows = t.shape()[0];
                    if rows != 2 * h.nv {
                        return Err(bad(
                            path,
                            format!(
                                "tensor `{name}` has {rows} rows; the metadata's {} value heads need {}",
                                h.nv,
                                2 * h.nv
                            ),
                        ));
                    }
                    let pick = |second: i32| -> Vec<i32> {
                        (0..nk)
                            .flat_map(|g| (0..r).map(move |j| g * 2 * r + second * r + j))
                            .collect()
                    };
                    (pick(0), pick(1))
                }
            };
            out.put_named(
                &format!("{}.{first}", at.layer),
                t.rows(&a, false, name, path)?,
                ty,
            );
            out.put_named(
                &format!("{}.{second}", at.layer),
                t.rows(&b, false, name, path)?,
                ty,
            );
            return Ok(());
        }
        let Some(to) = &self.to else {
            return Err(bad(
                path,
                format!("gguf tensor rule of `{name}` has no `to`"),
            ));
        };
        let to = format!("{}.{to}", at.layer);
        let flat = |t: &Tensor| -> Result<Array> { Ok(t.dense()?.reshape(&[-1])?) };
        match self.how {
            How::Keep => out.put_named(&to, t, ty),
            How::Conv => out.put_named(&to, t.map(|a| Ok(a.expand_dims(-1)?))?, ty),
            How::Flatten => out.dense(&to, flat(&t)?, ty),
            How::ALog => out.dense(&to, flat(&t)?.negative()?.log()?, ty),
            How::Row if t.shape().len() == 1 => {
                let t = match t.ready()? {
                    TensorData::Dense(a) => TensorData::Dense(a.reshape(&[1, -1])?),
                    other => other,
                };
                out.put_named(&to, Tensor::Ready(t), ty)
            }
            How::Row => out.put_named(&to, t, ty),
        }
        Ok(())
    }
}
