-- shardlock_instance.nonce: the start nonce of the process that beat last under the instance
-- id (random per start, the middle part of every owner it writes); NULL from versions before
-- this migration. A heartbeat writes the row only while it is its own, or nobody's that is
-- live (deregistered, or silent for longer than the heartbeat timeout): a process that
-- resumes after its id was taken over by another start finds the row taken and stops, and of
-- two starts under one id that beat the same row only one writes it. Deregistration is
-- checked against it too.
ALTER TABLE shardlock_instance
  ADD COLUMN nonce VARBINARY(32) NULL;
