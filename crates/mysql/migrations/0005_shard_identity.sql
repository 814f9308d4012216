-- shardlock_meta: facts about this shard's database.
--
-- fence-floor  every fence granted here from now on is above it: raised when keys move here
--              from another shard (to that shard's clock, which floored the fences of rows
--              already deleted there), so fences never go backwards across a move.
-- shard-id  a random id made when the tables were first created here. Together with the
--           server's host name, port and server_id it identifies the database a shard's URL
--           reaches: a reload that points a shard name at another database (new hardware, a
--           promoted replica, a restored copy on another server) is a move of all its keys,
--           not a rename.
CREATE TABLE IF NOT EXISTS shardlock_meta (
  name  VARCHAR(64)  NOT NULL,
  value VARCHAR(255) NOT NULL,
  PRIMARY KEY (name)
) ENGINE=InnoDB;

-- INSERT IGNORE only keeps the first values made; it decides no ownership.
INSERT IGNORE INTO shardlock_meta (name, value) VALUES ('shard-id', UUID());
INSERT IGNORE INTO shardlock_meta (name, value) VALUES ('fence-floor', '0');
