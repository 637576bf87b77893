//! Tensor parallelism over MLX's own distributed layer (mlx-c
//! `mlx_distributed_*`): the ring backend (TCP) on the CPU and Metal builds,
//! NCCL in the CUDA build.
//!
//! A [`Shard`] is this process's place in a group of ranks: which part of
//! each split weight it holds ([`Shard::part`]) and the collective that
//! joins the parts ([`Shard::all_sum`]). Layers split their weights through
//! the [`WeightLoader`](crate::weights::WeightLoader)'s split scopes
//! ([`Split`]); the residual stream and norms stay whole on every rank, the
//! embedding and output head split by vocabulary (a lookup summed, the
//! logits gathered: [`crate::nn::gather_vocab`]), so every rank computes
//! the same logits and samples the same token. The layout follows Megatron-LM (Shoeybi et
//! al. 2019: column-split input projections, row-split output projections,
//! one all-reduce each) as mlx-lm's `shard_linear` does.
//!
//! Ranks come from MLX's environment: `MLX_RANK` and `MLX_HOSTFILE` (ring),
//! or `MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP`, `NCCL_PORT` (NCCL).
//! `mlex ... --tp N` sets them for N local ranks (`mlex-cli`).

use crate::error::{Error, Result};
use mlx_rs::{ops, Array};
use std::sync::Arc;

/// Which of MLX's distributed backends a group runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectiveBackend {
    /// TCP between hosts (every build; CPU streams).
    Ring,
    /// NVIDIA's collectives (the CUDA build; GPU streams).
    Nccl,
}

impl CollectiveBackend {
    /// MLX's name for it.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveBackend::Ring => "ring",
            CollectiveBackend::Nccl => "nccl",
        }
    }
}

/// An MLX distributed group (owned; freed on drop).
struct Group {
    raw: mlx_sys::mlx_distributed_group,
}

// SAFETY: an mlx-c group is a handle to MLX's reference-counted C++ group,
// which MLX itself uses from its scheduler threads.
unsafe impl Send for Group {}
// SAFETY: as above; reads (rank, size) and collectives take it by value.
unsafe impl Sync for Group {}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: made by mlx_distributed_init, freed once.
        unsafe { mlx_sys::mlx_distributed_group_free(self.raw) };
    }
}

/// This process's rank of a tensor-parallel group.
#[derive(Clone)]
pub struct Shard {
    group: Arc<Group>,
    rank: usize,
    size: usize,
    backend: CollectiveBackend,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Shard(rank {} of {}, {})",
            self.rank,
            self.size,
            self.backend.name()
        )
    }
}

impl Shard {
    /// Joins the group MLX's environment describes on `backend` and checks
    /// that it has `size` ranks. An environment that names no group, or a
    /// group of another size, is an error naming `--tp` and the variables.
    pub fn join(backend: CollectiveBackend, size: usize) -> Result<Shard> {
        crate::device::ensure_error_handler();
        let name = std::ffi::CString::new(backend.name()).expect("no NUL");
        // SAFETY: mlx-c writes a group into `raw` on success; the error
        // handler mlx-rs installs turns a failure into a status.
        let (status, raw) = unsafe {
            let mut raw = mlx_sys::mlx_distributed_group_new();
            let status = mlx_sys::mlx_distributed_init(&mut raw, true, name.as_ptr());
            (status, raw)
        };
        if status != 0 {
            return Err(Error::invalid(
                "--tp",
                format!(
                    "MLX's {} backend could not join a group of {size} ranks (environment: {})",
                    backend.name(),
                    environment_summary()
                ),
            ));
        }
        let group = Group { raw };
        // SAFETY: a valid group.
        let (rank, found) = unsafe {
            (
                mlx_sys::mlx_distributed_group_rank(group.raw),
                mlx_sys::mlx_distributed_group_size(group.raw),
            )
        };
        if found as usize != size || rank < 0 {
            return Err(Error::invalid(
                "--tp",
                format!(
                    "asked for {size} ranks but MLX's {} group has {found} (environment: {})",
                    backend.name(),
                    environment_summary()
                ),
            ));
        }
        Ok(Shard {
            group: Arc::new(group),
            rank: rank as usize,
            size,
            backend,
        })
    }

    /// This process's rank, `0..size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the group has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The backend the group runs on.
    pub fn backend(&self) -> CollectiveBackend {
        self.backend
    }

    /// The sum of `x` over all ranks (lazy, like any MLX op; it runs when
    /// evaluated, inside compiled segments too).
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        self.collective("all_sum", x, mlx_sys::mlx_distributed_all_sum)
    }

    /// Every rank's `x` concatenated along axis 0, in rank order.
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        self.collective("all_gather", x, mlx_sys::mlx_distributed_all_gather)
    }

    fn collective(
        &self,
        what: &str,
        x: &Array,
        f: unsafe extern "C" fn(
            *mut mlx_sys::mlx_array,
            mlx_sys::mlx_array,
            mlx_sys::mlx_distributed_group,
            mlx_sys::mlx_stream,
        ) -> i32,
    ) -> Result<Array> {
        let stream = mlx_rs::Stream::thread_local_or_default();
        // SAFETY: `res` is a fresh array that mlx-c fills on success and
        // that we free on failure; the inputs outlive the call.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            if f(&mut res, x.as_ptr(), self.group.raw, stream.as_ptr()) != 0 {
                mlx_sys::mlx_array_free(res);
                return Err(Error::Other(format!(
                    "{what} over {} ranks ({}) failed for an array of shape {:?}",
                    self.size,
                    self.backend.name(),
                    x.shape()
                )));
            }
            Ok(Array::from_ptr(res))
        }
    }

    /// Rank 0's `values` on every rank (what the other ranks pass is
    /// ignored): its length, then its values, each summed with the other
    /// ranks' zeros. For what only rank 0 knows, e.g. a line it read.
    pub fn share_from_first(&self, values: &[i32]) -> Result<Vec<i32>> {
        let first = self.rank == 0;
        let len = if first { values.len() as i32 } else { 0 };
        let len = self.sum_ints(&[len])?[0];
        let mine: Vec<i32> = if first {
            values.to_vec()
        } else {
            vec![0; len.max(0) as usize]
        };
        if mine.is_empty() {
            return Ok(mine);
        }
        self.sum_ints(&mine)
    }

    /// Whether `flag` holds on any rank (e.g. a stop one rank saw).
    pub fn any(&self, flag: bool) -> Result<bool> {
        Ok(self.sum_ints(&[i32::from(flag)])?[0] > 0)
    }

    fn sum_ints(&self, values: &[i32]) -> Result<Vec<i32>> {
        let x = Array::from_slice(values, &[values.len() as i32]);
        let sum = self.all_sum(&x)?;
        sum.eval()?;
        Ok(sum.as_slice::<i32>().to_vec())
    }

    /// This rank's part of `x` cut into `size` equal parts along `axis`
    /// (a length that the ranks do not divide is an error naming `what`).
    pub fn part(&self, x: &Array, axis: usize, what: &str) -> Result<Array> {
        let len = x.shape()[axis];
        self.segmented_part(x, axis, &[(len, self.size)], what)
    }

    /// This rank's part of `x` whose `axis` is a concatenation of
    /// `segments`, each `(length, parts)`: a segment (e.g. the q, k or v
    /// rows of a projection) is cut into `parts` equal parts, `parts`
    /// dividing the ranks, and each part is held by `size / parts`
    /// consecutive ranks (fewer key/value heads than ranks: each rank
    /// keeps the head its query heads read). The rank keeps its part of
    /// each segment, in order.
    pub fn segmented_part(
        &self,
        x: &Array,
        axis: usize,
        segments: &[(i32, usize)],
        what: &str,
    ) -> Result<Array> {
        let ranges = self.part_ranges(x.shape()[axis], axis, segments, what)?;
        let index: Vec<i32> = ranges.iter().flat_map(|&(s, n)| s..s + n).collect();
        let n = index.len() as i32;
        // A gather, not a slice: a slice would be a view that keeps the
        // whole tensor's buffer alive once evaluated.
        Ok(ops::indexing::take_axis(
            x,
            Array::from_slice(&index, &[n]),
            axis as i32,
        )?)
    }

    /// The rows along `axis` (of `len`, the concatenation of `segments`,
    /// as in [`Shard::segmented_part`]) this rank keeps, as `(start,
    /// count)` runs in order.
    pub fn part_ranges(
        &self,
        len: i32,
        axis: usize,
        segments: &[(i32, usize)],
        what: &str,
    ) -> Result<Vec<(i32, i32)>> {
        if segments.iter().map(|&(n, _)| n).sum::<i32>() != len {
            return Err(Error::Other(format!(
                "{what}: {len} rows along axis {axis} are not the segments {segments:?}"
            )));
        }
        let mut ranges = Vec::with_capacity(segments.len());
        let mut at = 0;
        for &(seg, parts) in segments {
            if parts == 0
                || !self.size.is_multiple_of(parts)
                || !(seg as usize).is_multiple_of(parts)
            {
                return Err(Error::Other(format!(
                    "{what}: {seg} rows along axis {axis} do not split into {parts} equal parts \
                     for {} ranks (--tp {})",
                    self.size, self.size
                )));
            }
            let n = seg / parts as i32;
            let part = self.rank / (self.size / parts);
            ranges.push((at + n * part as i32, n));
            at += seg;
        }
        Ok(ranges)
    }
}

impl Shard {
    /// An error naming layer `index` of `arch` (planned as `lp`) when it
    /// was not built split ([`crate::layer::Layer::unsharded`]).
    pub fn check_built(
        &self,
        index: usize,
        lp: &crate::arch::LayerPlan,
        arch: &str,
        layer: &dyn crate::layer::Layer,
    ) -> Result<()> {
        match layer.unsharded() {
            None => Ok(()),
            Some(part) => Err(Error::Other(format!(
                "--tp {}: layer {index} ({}, `{}` of `{arch}`) cannot be split across ranks \
                 yet: {part} does not shard",
                self.size, lp.prefix, lp.name
            ))),
        }
    }
}

/// How the tensors a layer takes inside a split scope of the
/// [`WeightLoader`](crate::weights::WeightLoader) are cut across ranks.
/// Shapes given to the loader in a scope are this rank's; the checkpoint
/// holds `size` times as much along the split axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Column-parallel: a matrix's output rows (its second-last axis; a
    /// vector's only axis, e.g. a bias) are split, each rank computes its
    /// part of the output.
    Output,
    /// Row-parallel: a matrix's input columns (its last axis, in whole
    /// quantization groups) are split; vectors (a bias) stay whole. The
    /// products' parts are summed over ranks ([`Shard::all_sum`]).
    Input,
    /// Channel-parallel: every tensor's first axis (per-head or
    /// per-channel parameters, depthwise convolutions).
    Leading,
}

impl Split {
    /// The axis of a tensor of `ndim` dimensions this split cuts (`None`:
    /// the tensor stays whole).
    pub fn axis(self, ndim: usize) -> Option<usize> {
        match (self, ndim) {
            (_, 0) => None,
            (Split::Output, 1) => Some(0),
            (Split::Output, n) => Some(n - 2),
            (Split::Input, 1) => None,
            (Split::Input, n) => Some(n - 1),
            (Split::Leading, _) => Some(0),
        }
    }
}

/// The MLX variables that describe a group, for error messages.
fn environment_summary() -> String {
    let vars = ["MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "NCCL_HOST_IP"];
    let set: Vec<String> = vars
        .iter()
        .filter_map(|v| std::env::var(v).ok().map(|x| format!("{v}={x}")))
        .collect();
    if set.is_empty() {
        "none of MLX_RANK, MLX_HOSTFILE, MLX_WORLD_SIZE, NCCL_HOST_IP is set".into()
    } else {
        set.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::Split;

    #[test]
    fn splits_cut_the_axis_each_layout_needs() {
        // [out, in] weights, [E, out, in] experts, [out] biases.
        assert_eq!(Split::Output.axis(2), Some(0));
        assert_eq!(Split::Output.axis(3), Some(1));
        assert_eq!(Split::Output.axis(1), Some(0));
        assert_eq!(Split::Input.axis(2), Some(1));
        assert_eq!(Split::Input.axis(3), Some(2));
        assert_eq!(Split::Input.axis(1), None);
        assert_eq!(Split::Leading.axis(3), Some(0));
    }
}
