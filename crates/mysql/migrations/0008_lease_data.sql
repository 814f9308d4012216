-- shardlock_lease.data: a small payload the holder stored with its lease
-- (`LockGuard::set_data`), shown by inspect and list. data_owner: the owner that stored it.
-- Readers show data only while data_owner is the row's owner, so a later grant never shows an
-- earlier holder's data and no grant statement has to clear it.
ALTER TABLE shardlock_lease
  ADD COLUMN data_owner VARBINARY(191) NULL,
  ADD COLUMN data VARBINARY(1024) NULL;
