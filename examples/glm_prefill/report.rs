//! Number formatting and plain-text (markdown-shaped) tables.

use std::io::{self, Write};
use std::time::Duration;

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes in decimal units (7.07 GB, as the docs write sizes).
pub use kvlink_rig::measure::fmt_bytes as bytes;

/// A duration in milliseconds, 1 decimal.
pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// A table printed with `|` separators, columns padded; numeric-looking columns right-aligned.
pub struct Table {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headings.
    pub fn new<S: AsRef<str>>(head: &[S]) -> Self {
        Table {
            head: head.iter().map(|s| s.as_ref().to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row (missing cells are blank).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Writes the table, each line prefixed by `indent`.
    pub fn write(&self, out: &mut dyn Write, indent: &str) -> io::Result<()> {
        let n = self.head.len();
        let cell = |r: &Vec<String>, i: usize| r.get(i).cloned().unwrap_or_default();
        let mut width: Vec<usize> = self.head.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, w) in width.iter_mut().enumerate() {
                *w = (*w).max(cell(r, i).chars().count());
            }
        }
        let right: Vec<bool> = (0..n)
            .map(|i| {
                self.rows.iter().any(|r| {
                    cell(r, i)
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_ascii_digit())
                })
            })
            .collect();
        let line = |cells: Vec<String>| -> String {
            let mut s = String::from("|");
            for (i, c) in cells.iter().enumerate() {
                let pad = width[i].saturating_sub(c.chars().count());
                if right[i] {
                    s.push_str(&format!(" {}{} |", " ".repeat(pad), c));
                } else {
                    s.push_str(&format!(" {}{} |", c, " ".repeat(pad)));
                }
            }
            s
        };
        writeln!(out, "{indent}{}", line(self.head.clone()))?;
        let mut sep = String::from("|");
        for (i, w) in width.iter().enumerate() {
            if right[i] {
                sep.push_str(&format!("{}:|", "-".repeat(w + 1)));
            } else {
                sep.push_str(&format!("{}|", "-".repeat(w + 2)));
            }
        }
        writeln!(out, "{indent}{sep}")?;
        for r in &self.rows {
            writeln!(
                out,
                "{indent}{}",
                line((0..n).map(|i| cell(r, i)).collect())
            )?;
        }
        Ok(())
    }
}
