//! Which writer puts `memscope_dump`'s rows in the file: the page writer ([`super::bulk`]), or
//! plain SQL (one prepared `INSERT` per row, in the same transactions).
//!
//! The page writer is the fast path and the SQL writer the boring one kept beside it: SQL is used
//! for the whole DB when the user asks for it (`--writer sql`), when this build's SQLite has no
//! `sqlite_dbpage` table (a build without the workspace's `.cargo/config.toml`), or when the file
//! breaks one of the page writer's preconditions; and for one transaction when another process
//! has the DB open at its start (Insight or a user's `sqlite3` reading the live trace), so that
//! nothing the pages rely on can change under them. Both give the same rows with the same
//! rowids: the page writer numbers rows as SQLite does (the last rowid plus one).

use std::path::Path;
use std::sync::Arc;

use rusqlite::Connection;

use super::btree::Col;
use super::bulk::{BulkError, BulkTable, Files};
use super::DbWriter;

pub(super) struct DumpRows {
    /// The page writer, while it can be used for this DB.
    pages: Option<BulkTable>,
    /// Why the DB is written through SQL, when it is.
    why_sql: Option<String>,
    /// This transaction's rows go through the page writer.
    via_pages: bool,
    insert: String,
    /// Transactions written through SQL because another process had the DB open.
    shared_transactions: u64,
}

impl DumpRows {
    /// Rows of `table` (whose columns are `columns`) in `conn`'s DB at `path`, through `writer`
    /// where it can be used.
    pub fn open(
        conn: &Connection,
        path: &Path,
        table: &str,
        columns: &[&str],
        writer: DbWriter,
    ) -> Result<Self, BulkError> {
        let (pages, why_sql) = match writer {
            DbWriter::Sql => (None, Some("asked for (--writer sql)".to_owned())),
            DbWriter::Pages => match BulkTable::open(conn, path, table) {
                Ok(pages) => (Some(pages), None),
                Err(e @ (BulkError::NoDbpage | BulkError::Unsupported(_) | BulkError::NoTable(_))) => {
                    (None, Some(e.to_string()))
                }
                Err(e) => return Err(e),
            },
        };
        let names: Vec<String> = columns.iter().map(|c| format!("\"{c}\"")).collect();
        let marks: Vec<String> = (1..=columns.len()).map(|i| format!("?{i}")).collect();
        let insert = format!("INSERT INTO {table} ({}) VALUES ({})", names.join(", "), marks.join(", "));
        Ok(Self { pages, why_sql, via_pages: false, insert, shared_transactions: 0 })
    }

    /// The writer this DB uses ("pages" or "sql"), and why SQL when it is.
    pub fn writer(&self) -> (&'static str, Option<&str>) {
        match &self.why_sql {
            None => ("pages", None),
            Some(why) => ("sql", Some(why)),
        }
    }

    /// Transactions that went through SQL because another process had the DB open.
    pub fn shared_transactions(&self) -> u64 {
        self.shared_transactions
    }

    /// The descriptors the page writer holds, to be closed only after the connection.
    pub fn files(&self) -> Option<Arc<Files>> {
        self.pages.as_ref().map(BulkTable::files)
    }

    /// Begins a write transaction (`BEGIN IMMEDIATE`) and picks its writer.
    pub fn begin(&mut self, conn: &Connection) -> Result<(), BulkError> {
        self.via_pages = false;
        let Some(pages) = &mut self.pages else {
            return Ok(conn.execute_batch("BEGIN IMMEDIATE")?);
        };
        if pages.shared() {
            // SQL reads and changes the table this time: SQLite must see the pages written so
            // far, and the page writer reads the table's shape back next time.
            pages.hand_to_sql(conn, true);
            self.shared_transactions += 1;
            return Ok(conn.execute_batch("BEGIN IMMEDIATE")?);
        }
        conn.execute_batch("BEGIN IMMEDIATE")?;
        pages.begin(conn)?;
        self.via_pages = true;
        Ok(())
    }

    /// Appends one row inside the open transaction.
    pub fn append(&mut self, conn: &Connection, cols: &[Col<'_>]) -> Result<(), BulkError> {
        if self.via_pages {
            self.pages.as_mut().expect("via_pages").append(cols)?;
            return Ok(());
        }
        let params = cols.iter().map(|c| match *c {
            Col::Int(v) => rusqlite::types::ToSqlOutput::from(v),
            Col::Text(t) => rusqlite::types::ToSqlOutput::from(t),
        });
        conn.prepare_cached(&self.insert)?.execute(rusqlite::params_from_iter(params))?;
        Ok(())
    }

    /// Completes the transaction's rows: call before the commit.
    pub fn seal(&mut self, conn: &Connection) -> Result<(), BulkError> {
        match &mut self.pages {
            Some(pages) if self.via_pages => pages.seal(conn),
            _ => Ok(()),
        }
    }

    /// The transaction has committed.
    pub fn committed(&mut self) {
        if let Some(pages) = &mut self.pages {
            pages.committed();
        }
        self.via_pages = false;
    }

    /// SQL of its own is about to read or change the table (see [`BulkTable::hand_to_sql`]).
    pub fn hand_to_sql(&mut self, conn: &Connection, changes_table: bool) {
        if let Some(pages) = &mut self.pages {
            pages.hand_to_sql(conn, changes_table);
        }
    }
}

#[cfg(test)]
mod tests;
