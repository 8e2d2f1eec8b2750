// Creates an empty zero-cache 1.9.0 replica at replicaVersion = stateVersion = "01"
// (the demo source's replica version), with zero-cache's own schema functions, plus the
// app tables a Postgres initial sync would have copied: zero.permissions (anyone may read
// issues and comments), zero_0.clients and zero_0.mutations. The demo's own tables are
// NOT created: the demo sends create-table for them in its first transaction.
// Usage: node make-replica.mjs <file>
import { LogContext, consoleLogSink } from "@rocicorp/logger";
import { rmSync } from "node:fs";
import { fileURLToPath } from "node:url";

const Z = fileURLToPath(new URL("./node_modules/@rocicorp/zero/out/zero-cache/src", import.meta.url));
const { initReplica } = await import(`${Z}/services/change-source/common/replica-schema.js`);
const { initReplicationState } = await import(`${Z}/services/replicator/schema/replication-state.js`);
const { populateFromExistingTables } = await import(`${Z}/services/replicator/schema/column-metadata.js`);
const { listTables } = await import(`${Z}/db/lite-tables.js`);

const file = process.argv[2];
for (const suffix of ["", "-wal", "-wal2", "-shm"]) rmSync(file + suffix, { force: true });
const anyoneCanRead = JSON.stringify({
  tables: Object.fromEntries(
    ["issues", "comments"].map((t) => [t, { row: { select: [["allow", { type: "and", conditions: [] }]] } }]),
  ),
});
await initReplica(new LogContext("info", {}, consoleLogSink), "make-replica", file, (_log, tx) => {
  tx.exec(`
    CREATE TABLE "zero.permissions" ("permissions" "jsonb", "hash" "text", "lock" "bool|NOT_NULL", "_0_version" TEXT);
    CREATE UNIQUE INDEX "zero.permissions_pkey" ON "zero.permissions" ("lock" ASC);
    CREATE TABLE "zero_0.clients" ("clientGroupID" "text|NOT_NULL", "clientID" "text|NOT_NULL", "lastMutationID" "int8|NOT_NULL", "userID" "text", "_0_version" TEXT);
    CREATE UNIQUE INDEX "zero_0.clients_pkey" ON "zero_0.clients" ("clientGroupID" ASC, "clientID" ASC);
    CREATE TABLE "zero_0.mutations" ("clientGroupID" "text|NOT_NULL", "clientID" "text|NOT_NULL", "mutationID" "int8|NOT_NULL", "result" "json|NOT_NULL", "_0_version" TEXT);
    CREATE UNIQUE INDEX "zero_0.mutations_pkey" ON "zero_0.mutations" ("clientGroupID" ASC, "clientID" ASC, "mutationID" ASC);
  `);
  tx.prepare(
    `INSERT INTO "zero.permissions" ("permissions", "hash", "lock", "_0_version") VALUES (?, 'anyone-can-read', 1, '01')`,
  ).run(anyoneCanRead);
  initReplicationState(tx, ["_zero_public_0", "_zero_metadata_0"], "01");
  populateFromExistingTables(tx, listTables(tx, false, false));
});
console.log("created", file);
