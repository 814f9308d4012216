-- A least-privilege account for shardlock on one shard. Run as an administrator, then put
-- the password in the environment (`url: mysql://shardlock:${SHARDLOCK_DB_PASSWORD}@...`).
CREATE DATABASE IF NOT EXISTS shardlock;
CREATE USER IF NOT EXISTS 'shardlock'@'%' IDENTIFIED BY 'change-me';
-- Lease statements.
GRANT SELECT, INSERT, UPDATE, DELETE ON shardlock.* TO 'shardlock'@'%';
-- `shardlock migrate` (may be run by a separate deploy account instead).
GRANT CREATE, ALTER, INDEX ON shardlock.* TO 'shardlock'@'%';
-- `shardlock status` reads nothing else; no global privileges are needed.
