-- The holder's trace context, stored with its lease so that a waiter in another process can
-- link its acquire span to the holder's trace: a W3C traceparent
-- ('00-<trace id>-<span id>-<flags>') of the holder's acquire span, or NULL when the holder
-- was not traced.
ALTER TABLE shardlock_lease ADD COLUMN holder_trace VARCHAR(55) NULL;
