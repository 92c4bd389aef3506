//! Plain-text tables for the command line (shared by `certs` and `audit query`).

/// Left-aligned columns separated by at least three spaces.
pub fn render_table(rows: &[Vec<String>]) -> String {
    render_table_padded(rows, 3)
}

/// Left-aligned columns, each as wide as its widest cell plus `padding`
/// spaces; the last column is not padded (Go's tabwriter with flags 0).
pub fn render_table_padded(rows: &[Vec<String>], padding: usize) -> String {
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
