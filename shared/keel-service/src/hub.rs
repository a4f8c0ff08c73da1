//! Models named as on the Hugging Face Hub (`Qwen/Qwen3-0.6B`), found in the Hub's cache on
//! this host, laid out as `huggingface_hub` writes it:
//!
//! ```text
//! <cache>/models--Qwen--Qwen3-0.6B/refs/main            the commit `main` points at
//! <cache>/models--Qwen--Qwen3-0.6B/snapshots/<commit>/  the model's files (links into blobs/)
//! ```
//!
//! The cache is `HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`, as the
//! Hub's own libraries choose it. Nothing is downloaded here.

use std::path::{Path, PathBuf};

/// The Hub cache of this process's environment.
pub fn cache_dir() -> PathBuf {
    cache_dir_from(&|name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from))
}

fn cache_dir_from(env: &dyn Fn(&str) -> Option<PathBuf>) -> PathBuf {
    if let Some(cache) = env("HF_HUB_CACHE") {
        return cache;
    }
    if let Some(home) = env("HF_HOME") {
        return home.join("hub");
    }
    let base =
        env("XDG_CACHE_HOME").or_else(|| env("HOME").map(|h| h.join(".cache"))).unwrap_or_else(|| ".cache".into());
    base.join("huggingface").join("hub")
}

/// Why a model named as on the Hub cannot be found in the cache; the ones a download would
/// fix say how.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotCached {
    #[error("`{0}` is not a Hugging Face model id (`Org/Name`)")]
    BadName(String),
    #[error("revision `{0}` is not a branch, tag or commit")]
    BadRevision(String),
    #[error("{name} is not in the Hugging Face cache at {}: {}", cache.display(), fetch_hint(name))]
    Missing { name: String, cache: PathBuf },
    #[error("{name} has no snapshot for revision `{revision}` in {}: {}", repo.display(), fetch_hint(name))]
    NoSnapshot { name: String, revision: String, repo: PathBuf },
}

fn fetch_hint(name: &str) -> String {
    format!("fetch it into the cache first (`hf download {name}`), or set HF_HUB_CACHE or HF_HOME")
}

/// The snapshot directory of model `name` at `revision` (a branch or tag the cache has a ref
/// for, or a commit; `main` when None) in `cache`, or why there is none, saying how to get it.
pub fn snapshot(cache: &Path, name: &str, revision: Option<&str>) -> Result<PathBuf, NotCached> {
    check_name(name)?;
    let revision = revision.unwrap_or("main");
    if revision.is_empty() || revision.contains("..") || revision.starts_with('/') {
        return Err(NotCached::BadRevision(revision.to_string()));
    }
    let repo = cache.join(format!("models--{}", name.replace('/', "--")));
    if !repo.is_dir() {
        return Err(NotCached::Missing { name: name.to_string(), cache: cache.to_path_buf() });
    }
    let commit = match std::fs::read_to_string(repo.join("refs").join(revision)) {
        Ok(commit) => commit.trim().to_string(),
        // Not a ref the cache knows: a commit given as it is.
        Err(_) => revision.to_string(),
    };
    let dir = repo.join("snapshots").join(&commit);
    if !dir.is_dir() {
        return Err(NotCached::NoSnapshot { name: name.to_string(), revision: revision.to_string(), repo });
    }
    Ok(dir)
}

/// `Org/Name` or `Name`: the Hub's characters, no `..`.
fn check_name(name: &str) -> Result<(), NotCached> {
    let parts: Vec<&str> = name.split('/').collect();
    let valid_part = |p: &str| {
        !p.is_empty()
            && !p.contains("..")
            && !p.starts_with(['.', '-'])
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if parts.len() > 2 || !parts.iter().all(|p| valid_part(p)) {
        return Err(NotCached::BadName(name.to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_is_found_as_the_hubs_libraries_find_it() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| PathBuf::from(v))
        };
        assert_eq!(cache_dir_from(&env(&[("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h")])), Path::new("/c"));
        assert_eq!(cache_dir_from(&env(&[("HF_HOME", "/h"), ("HOME", "/home/u")])), Path::new("/h/hub"));
        assert_eq!(cache_dir_from(&env(&[("HOME", "/home/u")])), Path::new("/home/u/.cache/huggingface/hub"));
        assert_eq!(
            cache_dir_from(&env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/home/u")])),
            Path::new("/x/huggingface/hub")
        );
    }

    #[test]
    fn snapshots_are_found_by_ref_or_commit_and_missing_ones_say_how_to_get_them() {
        let cache = tempfile::tempdir().unwrap();
        let repo = cache.path().join("models--Org--Tiny-1.5B");
        std::fs::create_dir_all(repo.join("snapshots/abc123")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots/def456")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
        std::fs::write(repo.join("refs/v2"), "def456").unwrap();

        assert_eq!(snapshot(cache.path(), "Org/Tiny-1.5B", None).unwrap(), repo.join("snapshots/abc123"));
        assert_eq!(snapshot(cache.path(), "Org/Tiny-1.5B", Some("v2")).unwrap(), repo.join("snapshots/def456"));
        assert_eq!(snapshot(cache.path(), "Org/Tiny-1.5B", Some("def456")).unwrap(), repo.join("snapshots/def456"));

        let missing = snapshot(cache.path(), "Org/Other", None).unwrap_err().to_string();
        assert!(
            missing.contains("not in the Hugging Face cache") && missing.contains("hf download Org/Other"),
            "{missing}"
        );
        let no_revision = snapshot(cache.path(), "Org/Tiny-1.5B", Some("v3")).unwrap_err().to_string();
        assert!(no_revision.contains("no snapshot for revision `v3`"), "{no_revision}");
        for bad in ["../etc", "a/b/c", "Org/", "/abs", "Org/na me"] {
            assert!(
                snapshot(cache.path(), bad, None).unwrap_err().to_string().contains("not a Hugging Face model id"),
                "{bad}"
            );
        }
        assert!(snapshot(cache.path(), "Org/Tiny-1.5B", Some("../../x")).is_err());
    }
}
