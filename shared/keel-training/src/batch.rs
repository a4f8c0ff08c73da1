//! Wire batches ([`TrainBatch`], ragged rows) checked and turned into right-padded tensors,
//! and sliced into global batches and microbatches. Every inconsistency is refused with a
//! message naming the field, row and position.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use keel_protocol::trainer::{Advantages, TrainBatch};
use keel_protocol::training::LossConfig;

/// A checked batch on the CPU: [B, S] tensors padded to the longest row.
#[derive(Debug)]
pub struct Batch {
    pub input_ids: Tensor,
    pub lengths: Vec<i64>,
    pub token_mask: Tensor,
    pub sample_mask: Tensor,
    /// [B, S] like the logprobs: per-sample advantages are broadcast over their row.
    pub advantages: Option<Tensor>,
    pub prev_logprobs: Option<Tensor>,
    pub generation_logprobs: Option<Tensor>,
    pub reference_logprobs: Option<Tensor>,
    /// PPO: the critic's values the batch was scored with, and its targets.
    pub values: Option<Tensor>,
    pub returns: Option<Tensor>,
}

fn invalid(message: String) -> Error {
    Error::InvalidRequest(message)
}

/// Right-padded [B, S] i64 ids and the row lengths; rows must be non-empty.
pub fn pad_ids(rows: &[Vec<i64>]) -> Result<(Tensor, Vec<i64>)> {
    if rows.is_empty() {
        return Err(invalid("input_ids is empty".into()));
    }
    if let Some(row) = rows.iter().position(Vec::is_empty) {
        return Err(invalid(format!("input_ids row {row} is empty")));
    }
    let width = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut flat = vec![0i64; rows.len() * width];
    for (row, ids) in rows.iter().enumerate() {
        flat[row * width..row * width + ids.len()].copy_from_slice(ids);
    }
    let lengths = rows.iter().map(|r| r.len() as i64).collect();
    Ok((Tensor::from_slice(&flat).f_view([rows.len() as i64, width as i64])?, lengths))
}

/// A per-token field padded like the ids; every row must match its sequence's length and be finite.
fn pad_values(field: &str, rows: &[Vec<f32>], lengths: &[i64]) -> Result<Tensor> {
    if rows.len() != lengths.len() {
        return Err(invalid(format!("{field} has {} rows for {} sequences", rows.len(), lengths.len())));
    }
    let width = lengths.iter().copied().max().unwrap_or(0) as usize;
    let mut flat = vec![0f32; rows.len() * width];
    for (row, (values, &len)) in rows.iter().zip(lengths).enumerate() {
        if values.len() != len as usize {
            return Err(invalid(format!(
                "{field} row {row} has {} entries, input_ids row {row} has {len}",
                values.len()
            )));
        }
        if let Some(position) = values.iter().position(|v| !v.is_finite()) {
            return Err(invalid(format!("{field} row {row} position {position} is {}", values[position])));
        }
        flat[row * width..row * width + values.len()].copy_from_slice(values);
    }
    Ok(Tensor::from_slice(&flat).f_view([rows.len() as i64, width as i64])?)
}

fn per_sample(field: &str, values: &[f32], rows: usize) -> Result<Tensor> {
    if values.len() != rows {
        return Err(invalid(format!("{field} has {} entries for {rows} sequences", values.len())));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(invalid(format!("{field} entry {i} is {}", values[i])));
    }
    Ok(Tensor::from_slice(values))
}

impl Batch {
    /// Checks `batch` against what `loss` needs.
    pub fn new(batch: &TrainBatch, loss: &LossConfig) -> Result<Self> {
        let (input_ids, lengths) = pad_ids(&batch.input_ids)?;
        let rows = lengths.len();
        let token_mask = pad_values("token_mask", &batch.token_mask, &lengths)?;
        if token_mask.f_lt(0.0)?.f_any()?.f_int64_value(&[])? != 0 {
            return Err(invalid("token_mask has negative entries".into()));
        }
        let sample_mask = match &batch.sample_mask {
            Some(mask) => per_sample("sample_mask", mask, rows)?,
            None => Tensor::f_ones([rows as i64], (Kind::Float, Device::Cpu))?,
        };
        let advantages = match &batch.advantages {
            None => None,
            Some(Advantages::PerToken(values)) => Some(pad_values("advantages", values, &lengths)?),
            Some(Advantages::PerSample(values)) => {
                let width = input_ids.size()[1];
                Some(
                    per_sample("advantages", values, rows)?
                        .f_unsqueeze(1)?
                        .f_expand([rows as i64, width], false)?
                        .f_contiguous()?,
                )
            }
        };
        let logprobs = |field: &str, values: &Option<Vec<Vec<f32>>>| {
            values.as_deref().map(|v| pad_values(field, v, &lengths)).transpose()
        };
        let checked = Self {
            prev_logprobs: logprobs("prev_logprobs", &batch.prev_logprobs)?,
            generation_logprobs: logprobs("generation_logprobs", &batch.generation_logprobs)?,
            reference_logprobs: logprobs("reference_logprobs", &batch.reference_logprobs)?,
            values: logprobs("values", &batch.values)?,
            returns: logprobs("returns", &batch.returns)?,
            input_ids,
            lengths,
            token_mask,
            sample_mask,
            advantages,
        };
        if matches!(loss, LossConfig::ClippedPg(_)) && checked.advantages.is_none() {
            return Err(invalid("clipped_pg needs advantages (one per sample or one per token)".into()));
        }
        if checked.returns.is_some() != checked.values.is_some() {
            return Err(invalid("a batch that trains the critic needs both values and returns".into()));
        }
        if loss.is_pairwise() && rows % 2 != 0 {
            return Err(invalid(format!(
                "{} takes (chosen, rejected) pairs in consecutive rows; got an odd number of rows ({rows})",
                loss.name()
            )));
        }
        Ok(checked)
    }

    pub fn len(&self) -> usize {
        self.lengths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }

    /// Rows `rows` (in that order), trimmed to their longest sequence.
    pub fn select(&self, rows: &[usize]) -> Result<Batch> {
        let lengths: Vec<i64> = rows.iter().map(|&r| self.lengths[r]).collect();
        let width = lengths.iter().copied().max().unwrap_or(1);
        let index = Tensor::from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>());
        let pick = |x: &Tensor| -> Result<Tensor> { Ok(x.f_index_select(0, &index)?.f_narrow(1, 0, width)?) };
        let pick_opt = |x: &Option<Tensor>| x.as_ref().map(pick).transpose();
        Ok(Batch {
            input_ids: pick(&self.input_ids)?,
            token_mask: pick(&self.token_mask)?,
            sample_mask: self.sample_mask.f_index_select(0, &index)?,
            advantages: pick_opt(&self.advantages)?,
            prev_logprobs: pick_opt(&self.prev_logprobs)?,
            generation_logprobs: pick_opt(&self.generation_logprobs)?,
            reference_logprobs: pick_opt(&self.reference_logprobs)?,
            values: pick_opt(&self.values)?,
            returns: pick_opt(&self.returns)?,
            lengths,
        })
    }

    /// Rows `start..start + len`, trimmed to their longest sequence.
    pub fn rows(&self, start: usize, len: usize) -> Result<Batch> {
        let lengths = self.lengths[start..start + len].to_vec();
        let width = lengths.iter().copied().max().unwrap_or(1);
        let cut =
            |x: &Tensor| -> Result<Tensor> { Ok(x.f_narrow(0, start as i64, len as i64)?.f_narrow(1, 0, width)?) };
        let cut_opt = |x: &Option<Tensor>| x.as_ref().map(cut).transpose();
        Ok(Batch {
            input_ids: cut(&self.input_ids)?,
            token_mask: cut(&self.token_mask)?,
            sample_mask: self.sample_mask.f_narrow(0, start as i64, len as i64)?,
            advantages: cut_opt(&self.advantages)?,
            prev_logprobs: cut_opt(&self.prev_logprobs)?,
            generation_logprobs: cut_opt(&self.generation_logprobs)?,
            reference_logprobs: cut_opt(&self.reference_logprobs)?,
            values: cut_opt(&self.values)?,
            returns: cut_opt(&self.returns)?,
            lengths,
        })
    }
}

/// `len` rows split into consecutive chunks of at most `size`.
pub fn chunks(len: usize, size: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len).step_by(size.max(1)).map(move |start| (start, size.max(1).min(len - start)))
}

/// How the rows of a batch with `lengths` are split into microbatches: `rows` at a time, or
/// by a token budget (`Some((tokens, packed))`: packed tokens, or rows × their longest).
/// Pairwise losses keep each (chosen, rejected) pair of rows together and in order.
pub fn microbatches(lengths: &[i64], rows: usize, budget: Option<(usize, bool)>, pairwise: bool) -> Vec<Vec<usize>> {
    let Some((tokens, packed)) = budget else {
        return chunks(lengths.len(), rows).map(|(start, len)| (start..start + len).collect()).collect();
    };
    let unit = if pairwise { 2 } else { 1 };
    let units: Vec<&[i64]> = lengths.chunks(unit).collect();
    let bins = if packed {
        let sizes: Vec<i64> = units.iter().map(|u| u.iter().sum()).collect();
        keel_model::packed::first_fit_decreasing(&sizes, tokens as i64)
    } else {
        let longest: Vec<i64> = units.iter().map(|u| u.iter().copied().max().unwrap_or(0)).collect();
        keel_model::packed::length_sorted_bins(&longest, unit as i64, tokens as i64)
    };
    bins.into_iter()
        .map(|bin| bin.into_iter().flat_map(|u| u * unit..(u * unit + unit).min(lengths.len())).collect())
        .collect()
}

/// Ragged rows of a padded [B, S] tensor, each cut to its length.
pub fn unpad(values: &Tensor, lengths: &[i64]) -> Result<Vec<Vec<f32>>> {
    let values = values.f_to_device(Device::Cpu)?.f_to_kind(Kind::Float)?.f_contiguous()?;
    let width = values.size()[1] as usize;
    let flat = Vec::<f32>::try_from(values.f_flatten(0, -1)?)?;
    Ok(lengths.iter().enumerate().map(|(row, &len)| flat[row * width..row * width + len as usize].to_vec()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sft() -> LossConfig {
        LossConfig::Nll
    }

    #[test]
    fn rows_are_padded_and_mismatches_named() {
        let mut wire = TrainBatch {
            input_ids: vec![vec![1, 2, 3], vec![4, 5]],
            token_mask: vec![vec![0.0, 1.0, 1.0], vec![0.0, 1.0]],
            ..Default::default()
        };
        let batch = Batch::new(&wire, &sft()).unwrap();
        assert_eq!(batch.input_ids.size(), [2, 3]);
        assert_eq!(batch.lengths, [3, 2]);
        assert_eq!(Vec::<i64>::try_from(batch.input_ids.flatten(0, -1)).unwrap(), [1, 2, 3, 4, 5, 0]);
        let slice = batch.rows(1, 1).unwrap();
        assert_eq!(slice.input_ids.size(), [1, 2]);

        wire.token_mask[1].push(1.0);
        let err = Batch::new(&wire, &sft()).unwrap_err().to_string();
        assert_eq!(err, "token_mask row 1 has 3 entries, input_ids row 1 has 2");
        wire.token_mask[1].pop();
        wire.prev_logprobs = Some(vec![vec![0.0, -1.0, f32::NAN], vec![0.0, -1.0]]);
        let err = Batch::new(&wire, &sft()).unwrap_err().to_string();
        assert_eq!(err, "prev_logprobs row 0 position 2 is NaN");
        wire.prev_logprobs = None;
        let pg = LossConfig::ClippedPg(Default::default());
        assert!(Batch::new(&wire, &pg).unwrap_err().to_string().contains("needs advantages"));
        wire.advantages = Some(Advantages::PerSample(vec![1.0]));
        assert_eq!(Batch::new(&wire, &pg).unwrap_err().to_string(), "advantages has 1 entries for 2 sequences");
        wire.advantages = Some(Advantages::PerToken(vec![vec![0.0, 1.0, 2.0], vec![0.0]]));
        assert_eq!(
            Batch::new(&wire, &pg).unwrap_err().to_string(),
            "advantages row 1 has 1 entries, input_ids row 1 has 2"
        );
        // Per-sample advantages are broadcast over their rows, per-token ones padded like logprobs.
        wire.advantages = Some(Advantages::PerSample(vec![1.5, -2.0]));
        let broadcast = Batch::new(&wire, &pg).unwrap().advantages.unwrap();
        assert_eq!(Vec::<f32>::try_from(broadcast.flatten(0, -1)).unwrap(), [1.5, 1.5, 1.5, -2.0, -2.0, -2.0]);
        wire.advantages = Some(Advantages::PerToken(vec![vec![0.0, 1.0, 2.0], vec![0.0, 3.0]]));
        let per_token = Batch::new(&wire, &pg).unwrap().advantages.unwrap();
        assert_eq!(Vec::<f32>::try_from(per_token.flatten(0, -1)).unwrap(), [0.0, 1.0, 2.0, 0.0, 3.0, 0.0]);
        let json = serde_json::json!({"input_ids": [[1, 2]], "token_mask": [[0.0, 1.0]], "advantages": [[0.0, 0.5]]});
        let parsed: TrainBatch = serde_json::from_value(json).unwrap();
        assert_eq!(parsed.advantages, Some(Advantages::PerToken(vec![vec![0.0, 0.5]])));
        wire.advantages = None;
        wire.input_ids.push(vec![]);
        assert_eq!(Batch::new(&wire, &sft()).unwrap_err().to_string(), "input_ids row 2 is empty");
    }

    #[test]
    fn chunks_cover_every_row_once() {
        assert_eq!(chunks(10, 4).collect::<Vec<_>>(), [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(4, 4).collect::<Vec<_>>(), [(0, 4)]);
    }
}
