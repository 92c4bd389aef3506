//! Plain-text tables for the command line (shared by `certs` and `audit query`).

/// `header`, then `body`: left-aligned columns separated by at least three spaces.
pub fn render_table(header: &[&str], body: impl IntoIterator<Item = Vec<String>>) -> String {
    render_table_padded(header, body, 3)
}

/// `header`, then `body`: left-aligned columns, each as wide as its widest
/// cell plus `padding` spaces; the last column is not padded (Go's
/// tabwriter with flags 0).
pub fn render_table_padded(
    header: &[&str],
    body: impl IntoIterator<Item = Vec<String>>,
    padding: usize,
) -> String {
    let mut rows = vec![header.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    rows.extend(body);
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(String::len)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, cell)| format!("{cell:<w$}", w = widths[i]))
            .collect();
        out.push_str(cells.join(&" ".repeat(padding)).trim_end());
        out.push('\n');
    }
    out
}
