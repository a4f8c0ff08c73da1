//! `keel`: parse the command line, run the command, print any error as one line. A reader
//! that closed the pipe (`keel run show ID | head`) ends the command quietly.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = keel_cli::Cli::parse();
    match keel_cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) if keel_cli::closed_pipe(&err) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
