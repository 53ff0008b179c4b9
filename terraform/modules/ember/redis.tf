# ElastiCache Redis holds the rate-limit counters that several gateways share (on by default with more than one
# gateway): TLS in transit, encrypted at rest with the deployment's key, an auth token kept in Secrets Manager.

data "aws_secretsmanager_random_password" "redis" {
  count               = local.redis ? 1 : 0
  password_length     = 64
  exclude_punctuation = true
}

resource "aws_secretsmanager_secret" "redis" {
  #checkov:skip=CKV2_AWS_57:rotating an ElastiCache token needs a rotation Lambda; rotate by `terraform apply -replace`
  count                   = local.redis ? 1 : 0
  name_prefix             = "${var.name}-redis-auth-"
  kms_key_id              = aws_kms_key.ember.arn
  recovery_window_in_days = 0 # a destroyed deployment's token is worthless: nothing to recover
}

resource "aws_secretsmanager_secret_version" "redis" {
  count         = local.redis ? 1 : 0
  secret_id     = aws_secretsmanager_secret.redis[0].id
  secret_string = data.aws_secretsmanager_random_password.redis[0].random_password
  lifecycle {
    ignore_changes = [secret_string] # the data source draws a new password on every plan; keep the first
  }
}

resource "aws_elasticache_subnet_group" "redis" {
  count      = local.redis ? 1 : 0
  name       = "${var.name}-redis"
  subnet_ids = var.subnet_ids
}

resource "aws_elasticache_replication_group" "redis" {
  count                      = local.redis ? 1 : 0
  replication_group_id       = "${var.name}-redis"
  description                = "${var.name}: rate-limit state shared by the gateways"
  engine                     = "redis"
  engine_version             = "7.1"
  node_type                  = var.redis_node_type
  num_cache_clusters         = 2 # a replica in another zone takes over when the primary fails
  automatic_failover_enabled = true
  multi_az_enabled           = true
  port                       = 6379
  subnet_group_name          = aws_elasticache_subnet_group.redis[0].name
  security_group_ids         = [aws_security_group.redis[0].id]
  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.ember.arn
  transit_encryption_enabled = true
  auth_token                 = aws_secretsmanager_secret_version.redis[0].secret_string
  snapshot_retention_limit   = 1
  apply_immediately          = true
}
