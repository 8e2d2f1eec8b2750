// Prints the replica's stateVersion (the replica is in wal2 mode, which the sqlite3 CLI cannot open).
// Usage: node state-version.mjs <file>
import Database from "@rocicorp/zero-sqlite3";

const db = new Database(process.argv[2], { readonly: true });
const row = db.prepare(`SELECT "stateVersion" FROM "_zero.replicationState"`).get();
console.log(row.stateVersion);
