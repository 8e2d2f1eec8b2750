// Builds a replica with zero-cache 1.9.0's own code, for tests/replica/test_reference_parity.py:
// initReplica + initReplicationState at "01" (publications ["zero_data"], context {test: true}),
// then every message of <messages.json> through zero's ChangeProcessor in "serving" mode.
// Usage: node reference_apply.mjs <interop dir> <replica file> <messages.json>
import { readFileSync, rmSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [interop, file, messages] = process.argv.slice(2);
const load = (path) => import(pathToFileURL(`${interop}/node_modules/${path}`).href);
const Z = "@rocicorp/zero/out";
const { LogContext, consoleLogSink } = await load("@rocicorp/logger/out/logger.js");
const { initReplica } = await load(`${Z}/zero-cache/src/services/change-source/common/replica-schema.js`);
const { initReplicationState } = await load(`${Z}/zero-cache/src/services/replicator/schema/replication-state.js`);
const { ChangeProcessor } = await load(`${Z}/zero-cache/src/services/replicator/change-processor.js`);
const { StatementRunner } = await load(`${Z}/zero-cache/src/db/statements.js`);
const { Database } = await load(`${Z}/zqlite/src/db.js`);
const { parse } = await load(`${Z}/shared/src/bigint-json.js`);

for (const suffix of ["", "-wal", "-wal2", "-shm"]) rmSync(file + suffix, { force: true });
const lc = new LogContext("error", {}, consoleLogSink);
await initReplica(lc, "reference", file, (_lc, tx) =>
  initReplicationState(tx, ["zero_data"], "01", { test: true }),
);
const db = new Database(lc, file);
let failure = null;
const processor = new ChangeProcessor(new StatementRunner(db), "serving", (_lc, e) => {
  failure = e;
});
for (const message of parse(readFileSync(messages, "utf8"))) {
  processor.processMessage(lc, message);
  if (failure) {
    console.error(String(failure));
    process.exit(1);
  }
}
db.close();
