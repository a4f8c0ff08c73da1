//! `keel stack up|down|status`: the local stack of this checkout without the demo, left
//! running (the repository's `scripts/stack`, found from the working directory up), and the
//! settings file it writes (`.keel/stack.env`: the API URL and every token), which the other
//! commands read for a URL given neither as a flag nor in the environment (and then for its
//! token). So after
//! `keel stack up`, `keel run list` works in any shell of the checkout.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub enum StackCommand {
    /// Builds the release binaries (unless they are beside this `keel`), starts a
    /// nats-server and the five services, and writes `.keel/stack.env`.
    Up,
    /// Each service's health.
    Status,
    /// Stops what `up` started.
    Down,
}

/// The nearest directory from the working directory up that holds `relative`.
fn find_up(relative: &Path) -> Option<PathBuf> {
    let here = std::env::current_dir().ok()?;
    here.ancestors().map(|dir| dir.join(relative)).find(|path| path.exists())
}

/// `name` from the local stack's settings file (`$KEEL_STATE/stack.env`, else the nearest
/// `.keel/stack.env` from the working directory up), if there is one and it sets it.
pub fn setting(name: &str) -> Option<String> {
    let file = match std::env::var_os("KEEL_STATE") {
        Some(state) => Some(PathBuf::from(state).join("stack.env")).filter(|f| f.is_file()),
        None => find_up(Path::new(".keel/stack.env")),
    }?;
    let text = std::fs::read_to_string(file).ok()?;
    parse(&text, name)
}

/// The value `text` (`NAME=value` lines, `#` comments) gives `name`.
fn parse(text: &str, name: &str) -> Option<String> {
    text.lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .find_map(|line| line.strip_prefix(name)?.strip_prefix('=').map(str::to_string))
}

/// A service's URL and token (`<PREFIX>_URL`, `<PREFIX>_TOKEN`): as given (a flag or the
/// environment), else the local stack's, else `default` and none. The stack's token goes
/// only to the stack's URL, never to a URL given elsewhere.
pub fn endpoint(url: Option<String>, token: Option<String>, prefix: &str, default: &str) -> (String, Option<String>) {
    match url {
        Some(url) => (url, token),
        None => match setting(&format!("{prefix}_URL")) {
            Some(url) => (url, token.or_else(|| setting(&format!("{prefix}_TOKEN")))),
            None => (default.to_string(), token),
        },
    }
}

pub fn run(command: StackCommand) -> anyhow::Result<()> {
    let Some(script) = find_up(Path::new("scripts/stack")) else {
        bail!("no scripts/stack here or above: run `keel stack` in a Keel checkout");
    };
    let verb = match command {
        StackCommand::Up => "up",
        StackCommand::Status => "status",
        StackCommand::Down => "down",
    };
    let mut process = std::process::Command::new("bash");
    process.arg(&script).arg(verb);
    // The services built beside this `keel` are used as they are (no build).
    let here = std::env::current_exe().ok().and_then(|exe| exe.parent().map(Path::to_path_buf));
    if let Some(dir) = here.filter(|dir| dir.join("keel-orchestrator").is_file())
        && std::env::var_os("KEEL_BIN").is_none()
    {
        process.env("KEEL_BIN", dir).env("KEEL_SKIP_SETUP", "1");
    }
    let status = process.status().with_context(|| format!("cannot run {}", script.display()))?;
    if !status.success() {
        bail!("scripts/stack {verb} failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_read_by_name() {
        let text = "# a comment\nKEEL_API_URL=http://127.0.0.1:8180\nKEEL_API_TOKEN=abc=def\n";
        assert_eq!(parse(text, "KEEL_API_URL").as_deref(), Some("http://127.0.0.1:8180"));
        assert_eq!(parse(text, "KEEL_API_TOKEN").as_deref(), Some("abc=def"));
        assert_eq!(parse(text, "KEEL_API"), None);
        assert_eq!(parse(text, "KEEL_REWARD_TOKEN"), None);
    }
}
