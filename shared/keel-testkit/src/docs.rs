//! The book's reference pages are generated from the code: a page under
//! `docs/src/reference/` has a hand-written introduction, then [`GENERATED_MARKER`], then
//! what a test makes. [`check_reference_page`] fails when that part drifts from the code;
//! with `KEEL_UPDATE_DOCS=1` it writes it instead.

use std::path::PathBuf;

/// The line after which a reference page is generated.
pub const GENERATED_MARKER: &str = "<!-- generated: do not edit below -->";

/// Checks (or, with `KEEL_UPDATE_DOCS=1`, writes) the generated part of
/// `docs/src/reference/<page>`; `regenerate` is the command that writes it, named in the
/// failure.
pub fn check_reference_page(page: &str, generated: &str, regenerate: &str) {
    let path: PathBuf = crate::workspace_root().join("docs/src/reference").join(page);
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let Some(at) = committed.find(GENERATED_MARKER) else {
        panic!("{} has no `{GENERATED_MARKER}` line", path.display());
    };
    let head = &committed[..at + GENERATED_MARKER.len()];
    let expected = format!("{head}\n\n{}\n", generated.trim_end());
    if std::env::var_os("KEEL_UPDATE_DOCS").is_some() && committed != expected {
        std::fs::write(&path, &expected).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        return;
    }
    assert!(
        committed == expected,
        "{} is out of date with the code: run KEEL_UPDATE_DOCS=1 {regenerate}",
        path.display()
    );
}

/// Escapes text for one cell of a Markdown table (pipes, line breaks).
pub fn table_cell(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|")
}

/// Checks that the `## <service>` section of `docs/src/reference/settings.md` names every
/// field of the service's configuration, nested ones by their dotted path (`group.rank`), as
/// its defaults serialise (`defaults`): a setting added in the code and not on the page fails.
/// An optional table that is unset by default counts as named when any of its fields is.
pub fn check_settings_section(service: &str, defaults: &serde_json::Value) {
    let path = crate::workspace_root().join("docs/src/reference/settings.md");
    let page = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let heading = format!("\n## {service}\n");
    let start = page.find(&heading).unwrap_or_else(|| panic!("{} has no `## {service}` section", path.display()));
    let rest = &page[start + heading.len()..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let mut leaves = Vec::new();
    settings_leaves(defaults, String::new(), &mut leaves);
    let missing: Vec<&String> = leaves
        .iter()
        .filter(|(field, value)| {
            let named = section.contains(&format!("`{field}`"));
            let table_named = value.is_null() && section.contains(&format!("`{field}."));
            !named && !table_named
        })
        .map(|(field, _)| field)
        .collect();
    assert!(missing.is_empty(), "{}, section {service}, does not name the settings {missing:?}", path.display());
}

fn settings_leaves(value: &serde_json::Value, path: String, out: &mut Vec<(String, serde_json::Value)>) {
    match value.as_object() {
        Some(fields) if !fields.is_empty() => {
            for (name, inner) in fields {
                let nested = if path.is_empty() { name.clone() } else { format!("{path}.{name}") };
                settings_leaves(inner, nested, out);
            }
        }
        _ => out.push((path, value.clone())),
    }
}

/// The test that a service's section of the settings reference names every field of its
/// configuration, for a service crate whose root has `SERVICE` and `default_config()`:
/// `#[cfg(test)] keel_testkit::settings_reference_test!();` there.
#[macro_export]
macro_rules! settings_reference_test {
    () => {
        mod settings_reference {
            #[test]
            fn every_setting_is_in_the_settings_reference() {
                let defaults = serde_json::to_value(super::default_config()).expect("the defaults serialise");
                $crate::docs::check_settings_section(super::SERVICE, &defaults);
            }
        }
    };
}
