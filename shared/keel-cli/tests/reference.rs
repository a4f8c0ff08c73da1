//! `docs/src/reference/cli.md` is generated from the clap tree: every command's help as
//! `keel <command> --help` prints it. This test fails when the page drifts from the code;
//! `KEEL_UPDATE_DOCS=1 cargo nextest run -p keel-cli --test reference` writes it.

#![cfg(feature = "engines")]

use clap::CommandFactory;
use keel_cli::Cli;

/// `command`'s help under a heading of its full name, then each visible subcommand's.
fn describe(command: &clap::Command, name: &str, out: &mut String) {
    let help = command.clone().render_long_help().to_string();
    let help: Vec<&str> = help.lines().map(str::trim_end).collect();
    out.push_str(&format!("## `{name}`\n\n```text\n{}\n```\n\n", help.join("\n").trim_end()));
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
        describe(sub, &format!("{name} {}", sub.get_name()), out);
    }
}

#[test]
fn the_cli_reference_page_is_the_help_of_every_command() {
    let mut root = Cli::command().term_width(100);
    root.build();
    let mut page = String::new();
    describe(&root, "keel", &mut page);
    assert!(page.contains("## `keel run submit`"), "the run commands are on the page");
    assert!(page.contains("## `keel model init`"), "the model commands are on the page");
    keel_testkit::docs::check_reference_page("cli.md", &page, "cargo nextest run -p keel-cli --test reference");
}
