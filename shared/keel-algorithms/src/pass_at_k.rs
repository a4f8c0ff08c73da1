//! The unbiased pass@k estimator: with n samples of which c are correct,
//! pass@k = 1 − C(n − c, k) / C(n, k) (1 when n − c < k), computed as a product so large n
//! does not overflow.

use crate::{Error, Result};

pub fn pass_at_k(n: usize, c: usize, k: usize) -> Result<f64> {
    if k == 0 || k > n || c > n {
        return Err(Error::InvalidPassAtK { n, c, k });
    }
    if n - c < k {
        return Ok(1.0);
    }
    // C(n−c, k)/C(n, k) = Π_{i = n−c+1}^{n} (1 − k/i)
    let miss: f64 = ((n - c + 1)..=n).map(|i| 1.0 - k as f64 / i as f64).product();
    Ok(1.0 - miss)
}

/// pass@k averaged over prompts, each given as (samples, correct).
pub fn mean_pass_at_k(per_prompt: &[(usize, usize)], k: usize) -> Result<f64> {
    if per_prompt.is_empty() {
        return Err(Error::Empty);
    }
    let total = per_prompt.iter().map(|&(n, c)| pass_at_k(n, c, k)).sum::<Result<f64>>()?;
    Ok(total / per_prompt.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binomial(n: u64, k: u64) -> f64 {
        (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
    }

    #[test]
    fn matches_the_binomial_formula() {
        for n in 1..=12usize {
            for c in 0..=n {
                for k in 1..=n {
                    let expected = if n - c < k {
                        1.0
                    } else {
                        1.0 - binomial((n - c) as u64, k as u64) / binomial(n as u64, k as u64)
                    };
                    let got = pass_at_k(n, c, k).unwrap();
                    assert!((got - expected).abs() < 1e-12, "n={n} c={c} k={k}: {got} vs {expected}");
                }
            }
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(pass_at_k(10, 0, 1).unwrap(), 0.0);
        assert!((pass_at_k(10, 3, 1).unwrap() - 0.3).abs() < 1e-12);
        assert_eq!(pass_at_k(5, 5, 5).unwrap(), 1.0);
        assert!((pass_at_k(4, 1, 2).unwrap() - 0.5).abs() < 1e-12);
        assert!((mean_pass_at_k(&[(4, 1), (4, 4)], 2).unwrap() - 0.75).abs() < 1e-12);
        // Large n stays finite.
        assert!(pass_at_k(100_000, 10, 1000).unwrap().is_finite());
    }

    #[test]
    fn invalid_arguments() {
        assert_eq!(pass_at_k(3, 1, 4).unwrap_err(), Error::InvalidPassAtK { n: 3, c: 1, k: 4 });
        assert!(pass_at_k(3, 4, 1).is_err());
        assert!(pass_at_k(3, 1, 0).is_err());
        assert_eq!(mean_pass_at_k(&[], 1).unwrap_err(), Error::Empty);
    }
}
