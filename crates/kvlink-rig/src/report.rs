//! The result table of the GPU tests and the examples: rows PASS / FAIL / SKIP / info, each
//! logged to stderr as it comes, printed as a table that ends with the line `N passed, N
//! failed`.

use std::fmt::Write as _;

use kv_device::DeviceError;

/// Outcome of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Checked and right.
    Pass,
    /// Checked and wrong (or it errored).
    Fail,
    /// Not run here (too few GPUs, not enough memory, out of time).
    Skip,
    /// A measurement or a fact.
    Info,
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Row {
    /// The part of the run, e.g. `correctness` or `bench`.
    pub section: &'static str,
    /// What was checked or measured.
    pub name: String,
    /// Its outcome.
    pub status: Status,
    /// The detail: numbers, or why it failed.
    pub value: String,
}

/// Rows in the order they were produced (each also logged to stderr as it comes, so a run
/// cut short still leaves its rows in the log).
#[derive(Debug, Default)]
pub struct Report {
    /// Every row so far.
    pub rows: Vec<Row>,
}

impl Report {
    /// Adds a row (and logs it to stderr).
    pub fn push(
        &mut self,
        section: &'static str,
        name: impl Into<String>,
        status: Status,
        value: impl Into<String>,
    ) {
        let row = Row {
            section,
            name: name.into(),
            status,
            value: value.into(),
        };
        eprintln!(
            "[{:?}] {} / {}: {}",
            row.status, row.section, row.name, row.value
        );
        self.rows.push(row);
    }

    /// Adds an info row: a measurement or a fact.
    pub fn info(
        &mut self,
        section: &'static str,
        name: impl Into<String>,
        value: impl Into<String>,
    ) {
        self.push(section, name, Status::Info, value);
    }

    /// `Ok(detail)` → PASS, `Err` → FAIL; a panic inside `f` is caught → FAIL. Returns
    /// whether it passed.
    pub fn check<F>(&mut self, section: &'static str, name: &str, f: F) -> bool
    where
        F: FnOnce() -> Result<String, String>,
    {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(v)) => {
                self.push(section, name, Status::Pass, v);
                true
            }
            Ok(Err(e)) => {
                self.push(section, name, Status::Fail, e);
                false
            }
            Err(p) => {
                self.push(
                    section,
                    name,
                    Status::Fail,
                    format!("PANIC: {}", panic_msg(&*p)),
                );
                false
            }
        }
    }

    /// Runs one part of a program; a panic that escapes its own checks becomes a FAIL row
    /// `(section aborted)`, and the program goes on.
    pub fn section(&mut self, name: &'static str, f: impl FnOnce(&mut Report)) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self)));
        if let Err(p) = r {
            self.push(
                name,
                "(section aborted)",
                Status::Fail,
                format!("PANIC: {}", panic_msg(&*p)),
            );
        }
    }

    /// Whether any row failed.
    pub fn failed(&self) -> bool {
        self.rows.iter().any(|r| r.status == Status::Fail)
    }

    /// Rows that passed.
    pub fn passed(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| r.status == Status::Pass)
            .count()
    }

    /// The rows as a table; its last line is `N passed, N failed`.
    pub fn table(&self) -> String {
        let w_sec = self.rows.iter().map(|r| r.section.len()).max().unwrap_or(7);
        let w_sec = w_sec.max(7);
        let w_name = self.rows.iter().map(|r| r.name.len()).max().unwrap_or(5);
        let w_name = w_name.max(5);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<w_sec$}  {:<w_name$}  {:<6}  value",
            "section", "check", "result"
        );
        let _ = writeln!(s, "{}", "-".repeat(w_sec + w_name + 20));
        for r in &self.rows {
            let st = match r.status {
                Status::Pass => "PASS",
                Status::Fail => "FAIL",
                Status::Skip => "SKIP",
                Status::Info => "info",
            };
            let _ = writeln!(
                s,
                "{:<w_sec$}  {:<w_name$}  {:<6}  {}",
                r.section, r.name, st, r.value
            );
        }
        let count = |st: Status| self.rows.iter().filter(|r| r.status == st).count();
        let _ = writeln!(s, "{} skipped", count(Status::Skip));
        let _ = writeln!(
            s,
            "{} passed, {} failed",
            count(Status::Pass),
            count(Status::Fail)
        );
        s
    }
}

/// The text of a panic payload.
pub fn panic_msg(p: &(dyn std::any::Any + Send)) -> String {
    kv_loader::Cause::from_panic(p).detail().to_string()
}

/// Error text of a device error.
pub fn de(e: DeviceError) -> String {
    e.to_string()
}
