"""Postgres as the upstream: logical replication with pgoutput (spec/source.md §5).

``pgoutput`` decodes the replication protocol's bytes, ``values`` turns Postgres text
values into the JSON the reference emits, ``shard``/``published``/``ddl`` set up and
watch the upstream, ``connection`` is the replication socket, ``source`` ties them
into a :class:`app.sources.base.ChangeSource`.
"""
