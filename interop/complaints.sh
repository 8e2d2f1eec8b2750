# Sourced by the interop scripts: the one check that a zero-cache log holds no complaint.
#
#   first_complaint LOGFILE   # prints the first complaining line (600 chars), or nothing
#
# Not complaints: a view-syncer whose last client left stops with an info-level
# "Reconnect required" ProtocolError of kind Rehome (zero-cache's own idle shutdown), and
# the info-level "WebSocket closed" ProtocolError of a client that left while a poke was
# on its way.
first_complaint() {
  grep -iE "SchemaValidation|invalid|unexpected ack|ProtocolError|Unable to reserve snapshot" "$1" |
    grep -v '"kind":"Rehome"' | grep -v '"message":"WebSocket closed"' | head -1 | cut -c1-600 || true
}
