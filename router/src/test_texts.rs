//! Tests only: the texts of this crate's evaluation sets, for the unit tests
//! that check a shortcut (a window, a gate) changes no result on real input.

/// Every case line of `tests/corpus/*.jsonl` and `tests/blind/*.jsonl` (the
/// raw JSON line: the text and its labels, which only adds input).
pub(crate) fn case_lines() -> Vec<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests");
    ["corpus", "blind"]
        .iter()
        .filter_map(|d| std::fs::read_dir(format!("{dir}/{d}")).ok())
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .flat_map(|s| s.lines().map(String::from).collect::<Vec<_>>())
        .collect()
}
