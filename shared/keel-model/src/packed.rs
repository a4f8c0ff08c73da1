//! Sequence packing for training and scoring passes: several sequences laid end to end in one
//! row, each with its own positions (restarting at 0) and attending only to itself, so a
//! batch of mixed lengths spends no work on padding. [`PackedRow`] holds the row and where
//! each sequence lies; the models' `packed_*` passes take it and give the logprobs back in
//! the right-padded [n, S] layout the losses read, equal to an unpacked pass's.

use tch::{Device, Tensor};

use crate::attention::{Mask, Masks};
use crate::error::{Error, Result};

/// Sequences laid end to end in one row.
#[derive(Debug)]
pub struct PackedRow {
    /// [1, T] i64: the sequences' ids one after another.
    pub ids: Tensor,
    /// (start, length) of each sequence in the row, in order.
    pub spans: Vec<(i64, i64)>,
}

impl PackedRow {
    /// Packs rows of right-padded `ids` [n, S] with `lengths` (each 1..=S).
    pub fn new(ids: &Tensor, lengths: &[i64]) -> Result<Self> {
        let size = ids.size();
        if size.len() != 2 || size[0] != lengths.len() as i64 {
            return Err(Error::InvalidInput(format!("{} lengths for ids of shape {size:?}", lengths.len())));
        }
        if let Some(bad) = lengths.iter().find(|&&l| l < 1 || l > size[1]) {
            return Err(Error::InvalidInput(format!("sequence length {bad} is outside 1..={}", size[1])));
        }
        let mut spans = Vec::with_capacity(lengths.len());
        let mut parts = Vec::with_capacity(lengths.len());
        let mut start = 0;
        for (row, &len) in lengths.iter().enumerate() {
            parts.push(ids.f_select(0, row as i64)?.f_narrow(0, 0, len)?);
            spans.push((start, len));
            start += len;
        }
        Ok(Self { ids: Tensor::f_cat(&parts, 0)?.f_unsqueeze(0)?, spans })
    }

    /// Tokens in the row.
    pub fn len(&self) -> i64 {
        self.spans.last().map_or(0, |(start, len)| start + len)
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Each token's position in its own sequence, [1, T].
    pub(crate) fn positions(&self, device: Device) -> Result<Tensor> {
        let positions: Vec<i64> = self.spans.iter().flat_map(|&(_, len)| 0..len).collect();
        Ok(Tensor::from_slice(&positions).f_to_device(device)?.f_unsqueeze(0)?)
    }

    /// The first token of every sequence, [1, T] bool: nothing before it predicts it, so its
    /// logprob is 0 (as position 0 of an unpacked row).
    pub(crate) fn starts(&self, device: Device) -> Result<Tensor> {
        let mut starts = vec![false; self.len() as usize];
        for &(start, _) in &self.spans {
            starts[start as usize] = true;
        }
        Ok(Tensor::from_slice(&starts).f_to_device(device)?.f_unsqueeze(0)?)
    }

    /// One mask per distinct attention window among `windows`: each sequence attends to
    /// itself only.
    pub(crate) fn masks(&self, windows: &[Option<i64>]) -> Masks {
        let mut distinct = windows.to_vec();
        distinct.dedup();
        distinct.into_iter().map(|window| (window, Mask::Segments { spans: self.spans.clone(), window })).collect()
    }

    /// Per-token values of the row [1, T] back in the right-padded layout [n, S] (S the
    /// longest sequence), zero past each sequence's end; differentiable.
    pub fn unpack(&self, packed: &Tensor) -> Result<Tensor> {
        let width = self.spans.iter().map(|&(_, len)| len).max().unwrap_or(0);
        let rows = self
            .spans
            .iter()
            .map(|&(start, len)| {
                Ok(packed.f_select(0, 0)?.f_narrow(0, start, len)?.f_constant_pad_nd([0, width - len])?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::f_stack(&rows, 0)?)
    }
}

/// First-fit decreasing: the indices of `lengths` in bins whose lengths add up to at most
/// `budget` tokens (a longer item gets a bin of its own). Bins are listed in the order they
/// were opened, each holding its items longest first.
pub fn first_fit_decreasing(lengths: &[i64], budget: i64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut bins: Vec<(i64, Vec<usize>)> = Vec::new();
    for i in order {
        match bins.iter_mut().find(|(used, _)| used + lengths[i] <= budget) {
            Some((used, items)) => {
                *used += lengths[i];
                items.push(i);
            }
            None => bins.push((lengths[i], vec![i])),
        }
    }
    bins.into_iter().map(|(_, items)| items).collect()
}

/// Dynamic batching without packing: items of `rows` rows each, `lengths` long, sorted
/// longest first and cut into bins whose padded size (rows × the longest) stays within
/// `budget` tokens (a longer item gets a bin of its own).
pub fn length_sorted_bins(lengths: &[i64], rows: i64, budget: i64) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut bins: Vec<Vec<usize>> = Vec::new();
    for i in order {
        match bins.last_mut() {
            // Longest first: a bin's padded width is its first item's length.
            Some(bin) if lengths[bin[0]] * rows * (bin.len() as i64 + 1) <= budget => bin.push(i),
            _ => bins.push(vec![i]),
        }
    }
    bins
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_hold_their_budget_and_every_item_once() {
        let lengths = [5, 9, 2, 7, 3, 12, 1];
        let bins = first_fit_decreasing(&lengths, 12);
        assert_eq!(bins, [vec![5], vec![1, 4], vec![3, 0], vec![2, 6]]);
        let padded = length_sorted_bins(&lengths, 1, 20);
        assert_eq!(padded, [vec![5], vec![1, 3], vec![0, 4, 2, 6]]);
        for bins in [bins, padded] {
            let mut seen: Vec<usize> = bins.concat();
            seen.sort_unstable();
            assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn rows_pack_and_unpack() {
        let ids = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 0, 0]).view([2, 4]);
        let row = PackedRow::new(&ids, &[4, 2]).unwrap();
        assert_eq!(Vec::<i64>::try_from(row.ids.flatten(0, -1)).unwrap(), [1, 2, 3, 4, 5, 6]);
        assert_eq!(row.spans, [(0, 4), (4, 2)]);
        assert_eq!(
            Vec::<i64>::try_from(row.positions(Device::Cpu).unwrap().flatten(0, -1)).unwrap(),
            [0, 1, 2, 3, 0, 1]
        );
        let values = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 0.0, 5.0]).view([1, 6]);
        let back = row.unpack(&values).unwrap();
        assert_eq!(Vec::<f32>::try_from(back.flatten(0, -1)).unwrap(), [0.0, 1.0, 2.0, 3.0, 0.0, 5.0, 0.0, 0.0]);
        assert!(PackedRow::new(&ids, &[5, 2]).is_err());
    }
}
