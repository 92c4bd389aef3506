//! The flag reference (`docs/flags.md`), generated from the command line
//! itself: every subcommand's flags with their environment variable, default,
//! accepted values and help, grouped by clap's help headings. `meshca flags`
//! prints it; `tests/docs.rs` fails when the file differs from it.

use std::fmt::Write as _;

/// How to regenerate the file, printed in its header and by the test.
pub const REGENERATE: &str = "cargo run -- flags > docs/flags.md";

/// The whole reference for `cmd` (the `meshca` command), in Markdown.
pub fn markdown(cmd: &clap::Command) -> String {
    let mut cmd = cmd.clone();
    cmd.build();
    let name = cmd.get_name().to_string();
    let mut out = String::new();
    let _ = writeln!(out, "# {name} flags\n");
    let _ = writeln!(
        out,
        "<!-- Generated from the command line by `{REGENERATE}`: do not edit by hand. \
         tests/docs.rs fails when this file is out of date. -->\n"
    );
    out.push_str(
        "Every setting is a flag, and most have an environment variable beside it (Istio's name \
         where Istio has one); a flag given on the command line wins over its variable. \
         Durations are Go durations (`90s`, `10m`, `24h`). Each value is checked at startup: \
         one that is malformed, out of its range or could overflow later stops startup with an \
         error naming the flag or variable, before any CA material is generated.\n\n\
         This page is generated from the help texts in the source (`meshca <command> --help` \
         prints the same); to change it, change the `///` comment of the flag and run \
         `",
    );
    out.push_str(REGENERATE);
    out.push_str("`.\n\n");

    let globals: Vec<&clap::Arg> = documented(&cmd).filter(|a| a.is_global_set()).collect();
    let subcommands: Vec<&clap::Command> = visible_subcommands(&cmd).collect();
    out.push_str("## Commands\n\n");
    for sub in &subcommands {
        let path = format!("{name} {}", sub.get_name());
        let _ = writeln!(
            out,
            "- [`{path}`](#{}): {}",
            anchor(&path),
            first_line(sub.get_about())
        );
        for leaf in visible_subcommands(sub) {
            let path = format!("{path} {}", leaf.get_name());
            let _ = writeln!(
                out,
                "  - [`{path}`](#{}): {}",
                anchor(&path),
                first_line(leaf.get_about())
            );
        }
    }
    out.push('\n');
    if !globals.is_empty() {
        out.push_str("Flags every command takes:\n\n");
        table(&mut out, &globals);
    }
    for sub in subcommands {
        command(&mut out, sub, &name, 2);
    }
    out
}

/// One command's section (and its subcommands' after it).
fn command(out: &mut String, cmd: &clap::Command, parent: &str, level: usize) {
    let path = format!("{parent} {}", cmd.get_name());
    let _ = writeln!(out, "{} `{path}`\n", "#".repeat(level));
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        let _ = writeln!(out, "{}\n", about.to_string().trim());
    }
    let args: Vec<&clap::Arg> = documented(cmd).filter(|a| !a.is_global_set()).collect();
    // Arguments without a heading first, then each heading in the order clap
    // shows them in `--help`.
    let mut headings: Vec<Option<&str>> = vec![None];
    for a in &args {
        let h = a.get_help_heading();
        if !headings.contains(&h) {
            headings.push(h);
        }
    }
    for heading in headings {
        let group: Vec<&clap::Arg> = args
            .iter()
            .copied()
            .filter(|a| a.get_help_heading() == heading)
            .collect();
        if group.is_empty() {
            continue;
        }
        if let Some(h) = heading {
            let _ = writeln!(out, "{} {h}\n", "#".repeat(level + 1));
        }
        table(out, &group);
    }
    for sub in visible_subcommands(cmd) {
        command(out, sub, &path, level + 1);
    }
}

fn table(out: &mut String, args: &[&clap::Arg]) {
    out.push_str("| Flag | Env | Default | Meaning |\n|---|---|---|---|\n");
    for a in args {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            flag(a),
            a.get_env()
                .map(|e| format!("`{}`", e.to_string_lossy()))
                .unwrap_or_default(),
            default(a),
            cell(&meaning(a)),
        );
    }
    out.push('\n');
}

/// Arguments a user can set: not `--help`, `--version` or hidden ones.
fn documented(cmd: &clap::Command) -> impl Iterator<Item = &clap::Arg> {
    cmd.get_arguments().filter(|a| {
        !a.is_hide_set()
            && !matches!(
                a.get_action(),
                clap::ArgAction::Help
                    | clap::ArgAction::HelpShort
                    | clap::ArgAction::HelpLong
                    | clap::ArgAction::Version
            )
    })
}

fn visible_subcommands(cmd: &clap::Command) -> impl Iterator<Item = &clap::Command> {
    cmd.get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
}

fn flag(a: &clap::Arg) -> String {
    let mut names: Vec<String> = Vec::new();
    if let Some(l) = a.get_long() {
        names.push(format!("--{l}"));
    }
    if let Some(s) = a.get_short() {
        names.push(format!("-{s}"));
    }
    if names.is_empty() {
        // A positional argument.
        let many = matches!(a.get_num_args(), Some(r) if r.max_values() > 1);
        return format!("`{}{}`", value_name(a), if many { "..." } else { "" });
    }
    // The value is the Meaning column's business; a flag shows only its names.
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn value_name(a: &clap::Arg) -> String {
    match a.get_value_names() {
        Some(v) if !v.is_empty() => v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" "),
        _ => a.get_id().as_str().to_uppercase(),
    }
}

fn default(a: &clap::Arg) -> String {
    if matches!(
        a.get_action(),
        clap::ArgAction::SetTrue | clap::ArgAction::Count
    ) {
        return String::new();
    }
    let values: Vec<String> = a
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    match values.as_slice() {
        [] => String::new(),
        [one] if one.is_empty() => "(empty)".to_string(),
        _ => values
            .iter()
            .map(|v| format!("`{v}`"))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// The help text, and the values a closed set accepts when the help does not
/// already name them all.
fn meaning(a: &clap::Arg) -> String {
    let help = a
        .get_long_help()
        .or(a.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default();
    let help = help.trim().to_string();
    let values: Vec<String> = a
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| v.get_name().to_string())
        .collect();
    let is_bool = values.len() == 2 && values.iter().all(|v| v == "true" || v == "false");
    if values.is_empty()
        || is_bool
        || matches!(a.get_action(), clap::ArgAction::SetTrue)
        || values.iter().all(|v| help.contains(&format!("`{v}`")))
    {
        return help;
    }
    let list = values
        .iter()
        .map(|v| format!("`{v}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if help.is_empty() {
        format!("One of {list}.")
    } else {
        format!("{help}\n\nOne of {list}.")
    }
}

/// Text in one table cell: paragraphs joined with `<br>`, lines unwrapped,
/// pipes escaped.
fn cell(text: &str) -> String {
    text.split("\n\n")
        .map(|p| {
            p.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("<br><br>")
        .replace('|', "\\|")
}

fn first_line(about: Option<&clap::builder::StyledStr>) -> String {
    let text = about.map(|a| a.to_string()).unwrap_or_default();
    let text = cell(&text);
    // The first sentence.
    match text.find(". ") {
        Some(i) => text[..=i].to_string(),
        None => text,
    }
}

/// GitHub's heading anchor for a `` `path` `` heading.
fn anchor(path: &str) -> String {
    path.chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    fn cli() -> Command {
        Command::new("tool")
            .arg(
                Arg::new("log")
                    .long("log")
                    .global(true)
                    .default_value("plain")
                    .help("Log format."),
            )
            .subcommand(
                Command::new("serve")
                    .about("Serve it. More words.")
                    .arg(
                        Arg::new("dev")
                            .long("dev")
                            .action(ArgAction::SetTrue)
                            .help("Dev mode."),
                    )
                    .arg(
                        Arg::new("poll")
                            .long("poll")
                            .env("TOOL_POLL")
                            .default_value("2s")
                            .help_heading("Polling")
                            .help("How often.")
                            .long_help("How often.\n\nA | in the text, and a second\nline."),
                    )
                    .arg(Arg::new("secret").long("secret").hide(true))
                    .arg(
                        Arg::new("mode")
                            .long("mode")
                            .value_parser(["a", "b"])
                            .default_value("")
                            .help("Which."),
                    ),
            )
            .subcommand(
                Command::new("audit").about("Audit.").subcommand(
                    Command::new("verify")
                        .about("Verify.")
                        .arg(Arg::new("file").num_args(1..).value_name("FILE")),
                ),
            )
            .subcommand(Command::new("flags").hide(true))
    }

    #[test]
    fn every_visible_flag_with_env_default_heading_and_long_help() {
        let md = markdown(&cli());
        assert!(md.contains(REGENERATE), "{md}");
        assert!(
            md.contains("- [`tool serve`](#tool-serve): Serve it."),
            "{md}"
        );
        assert!(
            md.contains("  - [`tool audit verify`](#tool-audit-verify): Verify."),
            "{md}"
        );
        // The global flag once, at the top, not under each command.
        assert_eq!(md.matches("`--log`").count(), 1, "{md}");
        assert!(md.contains("| `--dev` |  |  | Dev mode. |"), "{md}");
        assert!(md.contains("### Polling\n\n| Flag"), "{md}");
        assert!(
            md.contains(
                "| `--poll` | `TOOL_POLL` | `2s` | How often.<br><br>A \\| in the text, and a second line. |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| `--mode` |  | (empty) | Which.<br><br>One of `a`, `b`. |"),
            "{md}"
        );
        assert!(md.contains("| `FILE...` |"), "{md}");
        assert!(!md.contains("secret"), "hidden flags stay out: {md}");
        assert!(
            !md.contains("`tool flags`"),
            "hidden commands stay out: {md}"
        );
        // Ungrouped flags come before the headed ones.
        assert!(md.find("`--dev`").unwrap() < md.find("### Polling").unwrap());
    }
}
