//! Rows that begin with the same tokens, computed once per shared beginning. A GRPO group's
//! samples all start with the group's prompt, DPO's chosen and rejected answers with theirs;
//! a padded pass runs that prompt through the model once per row. [`PrefixTree`] lays each
//! group of consecutive rows out as one tree row instead: the shared prefix once, then each
//! row's own tokens one after another at the positions that follow the prefix, attending to
//! the prefix and causally to themselves only. Every logprob is the one the padded pass gives
//! (the same sums, in another order), gradients included; the tree is used only when it
//! computes clearly fewer positions than the padded rows.

use tch::{Device, Kind, Tensor};

use crate::attention::{Mask, Masks};
use crate::error::Result;

/// The tree is used when it computes at most this share of the padded rows' positions.
const WORTHWHILE: f64 = 0.8;
/// The largest tree mask (groups × positions²); a longer tree runs as padded rows, whose
/// causal attention needs no explicit mask.
const MAX_MASK_ELEMENTS: i64 = 1 << 25;

/// Consecutive rows `first..first + rows` that share their first `prefix` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    first: usize,
    rows: usize,
    prefix: usize,
}

/// Right-padded rows laid out as one tree row per group of rows sharing a prefix.
#[derive(Debug)]
pub(crate) struct PrefixTree {
    /// [G, T] tokens of each tree (padding 0).
    pub(crate) ids: Tensor,
    /// [G, T] each token's position in its own sequence.
    pub(crate) positions: Tensor,
    /// [G, T] 0 for the prefix, i for the i-th row's own tokens, -1 for padding.
    segments: Tensor,
    /// [N] the tree position (flat over [G·T]) whose final hidden state predicts each target.
    sources: Tensor,
    /// [N] the predicted tokens.
    targets: Tensor,
    /// [B·S] which of the N logprobs each position of the padded layout takes.
    place: Tensor,
    /// [B, S] the padded positions without a logprob (each row's first token, padding).
    invalid: Tensor,
    rows: i64,
    width: i64,
}

impl PrefixTree {
    /// The tree layout of right-padded `ids` (row-major [B, S] on the host; each row's tokens
    /// past its length are ignored) when it saves enough work, else `None`.
    pub(crate) fn plan(ids: &[i64], width: usize, lengths: &[i64], device: Device) -> Result<Option<Self>> {
        let lengths: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        let row = |r: usize| &ids[r * width..r * width + lengths[r]];
        let groups = groups(&lengths, |a, b| common_prefix(row(a), row(b)));
        let tree_len = |g: &Group| g.prefix + (g.first..g.first + g.rows).map(|r| lengths[r] - g.prefix).sum::<usize>();
        let trees = groups.len() as i64;
        let tree_width = groups.iter().map(tree_len).max().unwrap_or(0) as i64;
        let padded_width = lengths.iter().copied().max().unwrap_or(0) as i64;
        let padded = lengths.len() as i64 * padded_width;
        if (trees * tree_width) as f64 > WORTHWHILE * padded as f64
            || trees * tree_width * tree_width > MAX_MASK_ELEMENTS
        {
            return Ok(None);
        }

        let t = tree_width as usize;
        let mut tree_ids = vec![0i64; groups.len() * t];
        let mut positions = vec![0i64; groups.len() * t];
        let mut segments = vec![-1i64; groups.len() * t];
        let (mut sources, mut targets) = (Vec::new(), Vec::new());
        let mut place = vec![0i64; lengths.len() * width];
        let mut invalid = vec![true; lengths.len() * width];
        let mut pair = |source: usize, target: i64| {
            sources.push(source as i64);
            targets.push(target);
            sources.len() as i64 - 1
        };
        for (g, group) in groups.iter().enumerate() {
            let base = g * t;
            let shared = &row(group.first)[..group.prefix];
            for (i, &id) in shared.iter().enumerate() {
                tree_ids[base + i] = id;
                positions[base + i] = i as i64;
                segments[base + i] = 0;
            }
            // The prefix's own logprobs, once for the group.
            let prefix_pairs: Vec<i64> = (1..group.prefix).map(|i| pair(base + i - 1, shared[i])).collect();
            let mut start = group.prefix;
            for (k, r) in (group.first..group.first + group.rows).enumerate() {
                let tokens = row(r);
                let own = tokens.len() - group.prefix;
                // The tree index of this row's token i.
                let at = |i: usize| if i < group.prefix { base + i } else { base + start + i - group.prefix };
                for (j, &id) in tokens[group.prefix..].iter().enumerate() {
                    tree_ids[base + start + j] = id;
                    positions[base + start + j] = (group.prefix + j) as i64;
                    segments[base + start + j] = k as i64 + 1;
                }
                for i in 1..tokens.len() {
                    place[r * width + i] =
                        if i < group.prefix { prefix_pairs[i - 1] } else { pair(at(i - 1), tokens[i]) };
                    invalid[r * width + i] = false;
                }
                start += own;
            }
        }
        if sources.is_empty() {
            return Ok(None);
        }
        let on = |values: &[i64], dims: &[i64]| -> Result<Tensor> {
            Ok(Tensor::from_slice(values).f_view(dims)?.f_to_device(device)?)
        };
        let (b, s) = (lengths.len() as i64, width as i64);
        Ok(Some(Self {
            ids: on(&tree_ids, &[trees, tree_width])?,
            positions: on(&positions, &[trees, tree_width])?,
            segments: on(&segments, &[trees, tree_width])?,
            sources: on(&sources, &[-1])?,
            targets: on(&targets, &[-1])?,
            place: on(&place, &[-1])?,
            invalid: Tensor::from_slice(&invalid).f_view([b, s])?.f_to_device(device)?,
            rows: b,
            width: s,
        }))
    }

    /// One mask per distinct attention window among `windows`: a token sees the keys of its
    /// own segment up to itself and the whole prefix (within the window, by position); a
    /// padding position sees itself only, so that no row of the attention is empty.
    pub(crate) fn masks(&self, windows: &[Option<i64>]) -> Result<Masks> {
        let (segment_q, segment_k) = (self.segments.f_unsqueeze(2)?, self.segments.f_unsqueeze(1)?);
        let (position_q, position_k) = (self.positions.f_unsqueeze(2)?, self.positions.f_unsqueeze(1)?);
        let visible = segment_q
            .f_eq_tensor(&segment_k)?
            .f_logical_or(&segment_k.f_eq(0)?)?
            .f_logical_and(&segment_k.f_ge(0)?)?
            .f_logical_and(&position_k.f_le_tensor(&position_q)?)?;
        let t = self.segments.size()[1];
        let itself = Tensor::f_eye(t, (Kind::Bool, self.segments.device()))?.f_unsqueeze(0)?;
        let padding = segment_q.f_lt(0)?.f_logical_and(&itself)?;
        let mut distinct = windows.to_vec();
        distinct.dedup();
        distinct
            .into_iter()
            .map(|window| {
                let mut allowed = visible.shallow_clone();
                if let Some(w) = window {
                    allowed = allowed.f_logical_and(&position_q.f_sub(&position_k)?.f_lt(w)?)?;
                }
                Ok((window, Mask::Allowed(allowed.f_logical_or(&padding)?.f_unsqueeze(1)?)))
            })
            .collect()
    }

    /// Token logprobs [B, S] in the padded layout from the trees' final hidden states
    /// [G, T, hidden]: the LM head `head` (hidden states → logits) runs on the N predicting
    /// positions only, `chunk` of them at a time, and `logprobs(logits, targets)` turns a
    /// chunk's f32 logits [n, vocab] (divided by `temperature`) into its targets' logprobs [n].
    /// Entry 0 and the padding of every row are 0; differentiable.
    pub(crate) fn logprobs(
        &self,
        hidden: &Tensor,
        head: impl Fn(&Tensor) -> Result<Tensor>,
        chunk: i64,
        temperature: f64,
        logprobs: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let states = hidden.f_reshape([-1, *hidden.size().last().unwrap_or(&0)])?;
        let n = self.sources.size()[0];
        let mut parts = Vec::new();
        let mut start = 0;
        while start < n {
            let len = chunk.max(1).min(n - start);
            let logits =
                head(&states.f_index_select(0, &self.sources.f_narrow(0, start, len)?)?)?.f_to_kind(Kind::Float)?;
            let logits = if temperature == 1.0 { logits } else { logits.f_div_scalar(temperature)? };
            parts.push(logprobs(&logits, &self.targets.f_narrow(0, start, len)?)?);
            start += len;
        }
        let pairs = Tensor::f_cat(&parts, 0)?;
        Ok(pairs.f_index_select(0, &self.place)?.f_view([self.rows, self.width])?.f_masked_fill(&self.invalid, 0.0)?)
    }
}

/// The length of the common beginning of `a` and `b`.
fn common_prefix(a: &[i64], b: &[i64]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Consecutive rows grouped greedily: a row joins the group before it when the shorter shared
/// prefix leaves fewer positions to compute than the row apart (`common(a, b)` is the common
/// prefix of rows a and b).
fn groups(lengths: &[usize], common: impl Fn(usize, usize) -> usize) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for (r, &len) in lengths.iter().enumerate() {
        if let Some(group) = groups.last_mut() {
            let shared = common(group.first, r).min(group.prefix);
            let own = |prefix: usize| (group.first..r).map(|q| lengths[q] - prefix).sum::<usize>();
            let joined = shared + own(shared) + (len - shared);
            let apart = group.prefix + own(group.prefix) + len;
            if joined < apart {
                group.prefix = shared;
                group.rows += 1;
                continue;
            }
        }
        groups.push(Group { first: r, rows: 1, prefix: len });
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpo_batch_groups_by_prompt() {
        // Two prompts of 4 tokens sharing 2 (a chat template's start), three samples each.
        let rows: Vec<Vec<i64>> = vec![
            vec![1, 2, 3, 4, 10, 11],
            vec![1, 2, 3, 4, 10, 12, 13],
            vec![1, 2, 3, 4, 14],
            vec![1, 2, 5, 6, 20, 21],
            vec![1, 2, 5, 6, 22],
            vec![1, 2, 5, 6, 20, 21, 23],
        ];
        let lengths: Vec<usize> = rows.iter().map(Vec::len).collect();
        let found = groups(&lengths, |a, b| common_prefix(&rows[a], &rows[b]));
        assert_eq!(
            found,
            vec![Group { first: 0, rows: 3, prefix: 4 }, Group { first: 3, rows: 3, prefix: 4 }],
            "the shared template beginning does not merge two prompts' groups"
        );
    }

    #[test]
    fn unrelated_rows_stay_apart_and_need_no_tree() {
        let rows: Vec<Vec<i64>> = vec![vec![1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]];
        let lengths: Vec<usize> = rows.iter().map(Vec::len).collect();
        let found = groups(&lengths, |a, b| common_prefix(&rows[a], &rows[b]));
        assert_eq!(found.len(), 3);
        let mut ids = vec![0i64; 3 * 4];
        for (r, row) in rows.iter().enumerate() {
            ids[r * 4..r * 4 + row.len()].copy_from_slice(row);
        }
        let lengths: Vec<i64> = rows.iter().map(|r| r.len() as i64).collect();
        assert!(PrefixTree::plan(&ids, 4, &lengths, Device::Cpu).unwrap().is_none(), "nothing to share");
    }

    #[test]
    fn identical_rows_share_everything() {
        let rows = [vec![3i64, 4, 5], vec![3, 4, 5], vec![3, 4, 5]];
        let found = groups(&[3, 3, 3], |a, b| common_prefix(&rows[a], &rows[b]));
        assert_eq!(found, vec![Group { first: 0, rows: 3, prefix: 3 }]);
        let ids: Vec<i64> = rows.concat();
        let tree = PrefixTree::plan(&ids, 3, &[3, 3, 3], Device::Cpu).unwrap().expect("one tree");
        assert_eq!(tree.ids.size(), [1, 3]);
        // Every row's logprobs are the prefix's: two pairs in all.
        assert_eq!(tree.sources.size(), [2]);
    }
}
