//! Which file names a checkpoint may hold: relative paths of at most 8 parts and 255
//! characters, each part letters, digits, `.`, `-`, `_` (not starting with `.`), so nothing
//! can climb out of the directory an export writes (`..`, absolute paths, odd characters and
//! hidden files are refused).

/// Checks `path`; the error says what is wrong with it.
pub fn check(path: &str) -> Result<(), String> {
    if path.is_empty() || path.len() > 255 {
        return Err(format!("file name `{path}` must be 1 to 255 characters"));
    }
    if path.starts_with('/') {
        return Err(format!("file name `{path}` must be relative"));
    }
    let parts: Vec<&str> = path.split('/').collect();
    if parts.len() > 8 {
        return Err(format!("file name `{path}` is nested more than 8 deep"));
    }
    for part in parts {
        if part.is_empty() || part.starts_with('.') {
            return Err(format!("file name `{path}` has an empty, `.`, `..` or hidden part"));
        }
        if !part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')) {
            return Err(format!("file name `{path}` may hold only letters, digits, `.`, `-`, `_` and `/`"));
        }
    }
    Ok(())
}

/// Whether `sha` is a lower-case hex sha256.
pub fn is_sha256(sha: &str) -> bool {
    sha.len() == 64 && sha.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traversal_and_odd_names_are_refused() {
        for good in ["model.safetensors", "tokenizer.json", "optimizer/state-0.pt", "a/b_c/d.e"] {
            assert!(check(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "../etc/passwd",
            "a/../../b",
            "/abs",
            "a//b",
            ".hidden",
            "a/./b",
            "sp ace",
            "semi;colon",
            "ü",
            "a\\b",
            "x\0y",
        ] {
            assert!(check(bad).is_err(), "{bad:?}");
        }
        assert!(check("a/".repeat(9).trim_end_matches('/')).is_err());
        assert!(is_sha256(&"ab".repeat(32)) && !is_sha256(&"AB".repeat(32)) && !is_sha256("abc"));
    }
}
