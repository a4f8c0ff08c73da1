//! Directories a service reads and writes on a request's behalf. A path a request names (a
//! model to load, a directory to save into, weights to serve) must resolve — symbolic links
//! followed, `..` refused — inside one of the service's roots, so a request cannot make the
//! service read or write anywhere else on its host.

use std::path::{Component, Path, PathBuf};

use crate::error::PathError;

/// The roots a service is configured with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathRoots {
    roots: Vec<PathBuf>,
    /// The configuration setting that lists them (named in refusals).
    setting: String,
}

/// The roots a service gets unless configured: `.keel` under the working directory (the
/// local stack's state), `/var/lib/keel` (the containers' volumes), the system's temporary
/// directory, `/dev/shm/keel-weights` (weights exported in shared memory) and the Hugging Face
/// cache ([`crate::hub::cache_dir`], where `model.name` finds models).
pub fn default_roots() -> Vec<PathBuf> {
    vec![
        PathBuf::from(".keel"),
        PathBuf::from("/var/lib/keel"),
        std::env::temp_dir(),
        PathBuf::from(SHARED_WEIGHTS_DIR),
        crate::hub::cache_dir(),
    ]
}

/// Where weights exported in shared memory go (one directory per run).
pub const SHARED_WEIGHTS_DIR: &str = "/dev/shm/keel-weights";

impl PathRoots {
    /// `roots` (relative ones against the working directory); `setting` names where they
    /// are configured, e.g. `KEEL_TRAINER__PATH_ROOTS`.
    pub fn new(roots: &[PathBuf], setting: &str) -> Result<Self, PathError> {
        if roots.is_empty() {
            return Err(PathError::NoRoots { setting: setting.to_string() });
        }
        let roots = roots
            .iter()
            .map(|root| {
                std::path::absolute(root).map_err(|source| PathError::BadRoot {
                    setting: setting.to_string(),
                    root: root.clone(),
                    source,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { roots, setting: setting.to_string() })
    }

    /// `path` resolved (absolute, links followed as far as it exists), if it lies inside a
    /// root; else an error naming `what`, the path and the setting to change.
    pub fn check(&self, what: &str, path: &str) -> Result<PathBuf, PathError> {
        self.inside(path).map_err(|e| PathError::Field { field: what.to_string(), source: Box::new(e) })
    }

    /// [`PathRoots::check`] with an error that names no field (for callers that name it
    /// themselves).
    pub fn inside(&self, path: &str) -> Result<PathBuf, PathError> {
        let given = Path::new(path);
        if path.is_empty() || given.components().any(|c| c == Component::ParentDir) {
            return Err(PathError::Climbs { path: path.to_string() });
        }
        let absolute =
            std::path::absolute(given).map_err(|source| PathError::Unresolvable { path: path.to_string(), source })?;
        let resolved = resolve(&absolute);
        if self.roots.iter().any(|root| resolved.starts_with(resolve(root))) {
            return Ok(resolved);
        }
        let roots: Vec<String> = self.roots.iter().map(|r| r.display().to_string()).collect();
        Err(PathError::Outside { path: path.to_string(), roots: roots.join(", "), setting: self.setting.clone() })
    }
}

/// `path` with its longest existing prefix canonicalised (links followed) and the rest as
/// given: a directory about to be made resolves where it will be made.
fn resolve(path: &Path) -> PathBuf {
    let mut existing = path;
    let mut rest = Vec::new();
    loop {
        if let Ok(canonical) = existing.canonicalize() {
            return rest.iter().rev().fold(canonical, |p, c| p.join(c));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return path.to_path_buf(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn paths_inside_the_roots_pass_and_others_are_refused_naming_the_setting() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join("root");
        std::fs::create_dir_all(root.join("models/m")).unwrap();
        let outside = scratch.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        let roots = PathRoots::new(std::slice::from_ref(&root), "KEEL_X__PATH_ROOTS").unwrap();
        let inside = roots.check("policy.path", root.join("models/m").to_str().unwrap()).unwrap();
        assert_eq!(inside, root.canonicalize().unwrap().join("models/m"));
        // Not there yet (a directory to save into) but inside: fine.
        roots.check("path", root.join("runs/r1/step-2").to_str().unwrap()).unwrap();
        let error = roots.check("path", outside.to_str().unwrap()).unwrap_err().to_string();
        assert!(error.contains("is outside") && error.contains("KEEL_X__PATH_ROOTS"), "{error}");
        let error = roots.check("path", &format!("{}/models/../../outside", root.display())).unwrap_err().to_string();
        assert!(error.contains("without `..`"), "{error}");
        assert!(roots.check("path", "").is_err());
        // A link inside the root that points out of it is followed, and refused.
        std::os::unix::fs::symlink(&outside, root.join("escape")).unwrap();
        let error = roots.check("path", root.join("escape/new").to_str().unwrap()).unwrap_err().to_string();
        assert!(error.contains("is outside"), "{error}");
        assert!(roots.check("path", "/etc/passwd").is_err());
        assert!(PathRoots::new(&[], "KEEL_X__PATH_ROOTS").is_err());
    }
}
