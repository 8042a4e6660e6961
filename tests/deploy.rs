//! The deployment files (docker/, every file under deploy/k8s/) and the README speak the CLI's
//! language: every `LIPSYNC_*` variable and every `lipsync serve` flag they use exists in
//! `lipsync serve --help`.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
}

/// Every file under `rel` (a directory of the repository), recursively, as repository paths.
fn files_under(rel: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    let mut dirs = vec![root.join(rel)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                if !path.ends_with("__pycache__") {
                    dirs.push(path);
                }
            } else {
                let rel = path.strip_prefix(root).unwrap();
                files.push(rel.to_str().unwrap().to_string());
            }
        }
    }
    files.sort();
    files
}

fn env_vars(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("LIPSYNC_") {
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        // `LIPSYNC_<FLAG>` and `LIPSYNC_*` are placeholders in prose.
        if name.len() > "LIPSYNC_".len() {
            out.insert(name);
        }
    }
    out
}

/// The `--flags` given to `serve` on a line (what follows the word `serve`).
fn flags(line: &str) -> impl Iterator<Item = String> + '_ {
    let args = line.split_once("serve").map_or("", |(_, rest)| rest);
    args.split(|c: char| c.is_whitespace() || "\"',[]`".contains(c))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.split('=').next().unwrap().to_string())
}

#[test]
fn docker_compose_and_readme_use_only_existing_serve_settings() {
    let help = Command::new(env!("CARGO_BIN_EXE_lipsync"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    let known_env = env_vars(&help);
    assert!(known_env.contains("LIPSYNC_PORT") && known_env.contains("LIPSYNC_API_KEY"));

    let mut used_env = BTreeSet::new();
    let mut used_flags = BTreeSet::new();
    let k8s = files_under("deploy/k8s");
    assert!(
        k8s.iter().any(|f| f.ends_with("deployment.yaml")),
        "{k8s:?}"
    );
    // Every file under docker/ (Dockerfiles, compose files, the balancer) and deploy/k8s.
    let docker = files_under("docker");
    assert!(
        docker.iter().any(|f| f.ends_with("compose.replicas.yaml")),
        "{docker:?}"
    );
    let files = std::iter::once("README.md".to_string())
        .chain(docker)
        .chain(k8s);
    for file in files {
        let text = read(&file);
        used_env.extend(env_vars(&text));
        for line in text
            .lines()
            .filter(|l| l.contains("lipsync serve") || l.contains("-- serve"))
        {
            used_flags.extend(flags(line));
        }
    }
    let unknown_env: Vec<_> = used_env.difference(&known_env).collect();
    assert!(
        unknown_env.is_empty(),
        "not in `lipsync serve --help`: {unknown_env:?}"
    );
    let unknown_flags: Vec<_> = used_flags
        .iter()
        .filter(|f| !help.contains(&format!("{f} ")) && !help.contains(&format!("{f}\n")))
        .collect();
    assert!(
        unknown_flags.is_empty(),
        "flags not in `lipsync serve --help`: {unknown_flags:?}"
    );
    // Every flag of serve has its LIPSYNC_ variable.
    for line in help
        .lines()
        .filter(|l| l.trim_start().starts_with("--") && !l.contains("--help"))
    {
        let flag = line.split_whitespace().next().unwrap();
        let want = format!(
            "LIPSYNC_{}",
            flag.trim_start_matches("--")
                .replace('-', "_")
                .to_uppercase()
        );
        assert!(help.contains(&want), "{flag} has no {want}");
    }
}
