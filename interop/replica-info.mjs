// Prints one JSON line about a zero replica (ours or zero-cache's; wal2 mode, so not the
// sqlite3 CLI): {replicaVersion, stateVersion, backfilling: ["table.column", ...],
// columns: {"table": ["column", ...]}} for the tables named after the file.
// Usage: node replica-info.mjs <file> [table ...]
import Database from "@rocicorp/zero-sqlite3";

const [file, ...tables] = process.argv.slice(2);
const db = new Database(file, { readonly: true });
const { replicaVersion } = db.prepare(`SELECT "replicaVersion" FROM "_zero.replicationConfig"`).get();
const { stateVersion } = db.prepare(`SELECT "stateVersion" FROM "_zero.replicationState"`).get();
const backfilling = db
  .prepare(`SELECT table_name, column_name FROM "_zero.column_metadata" WHERE backfill IS NOT NULL`)
  .all()
  .map((r) => `${r.table_name}.${r.column_name}`)
  .sort();
const columns = {};
for (const t of tables) {
  columns[t] = db
    .prepare(`SELECT name FROM pragma_table_info(?)`)
    .all(t)
    .map((r) => r.name);
}
console.log(JSON.stringify({ replicaVersion, stateVersion, backfilling, columns }));
