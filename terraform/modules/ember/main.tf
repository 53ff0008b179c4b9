# What `ember serve --backend aws` needs: one customer-managed KMS key, the package bucket (and a bucket for access
# logs), the nodes and replicas tables, log groups, a GPU node Auto Scaling Group whose desired capacity the gateway
# sets, the gateways behind an HTTPS load balancer with a WAF, and (with several gateways) Redis for shared limits.
# Network, compute, load balancer and Redis live in their own files beside this one.

locals {
  redis = coalesce(var.redis, var.gateway_count > 1)
  node_env = {
    EMBER_AWS_BUCKET = aws_s3_bucket.packages.bucket
    EMBER_AWS_TABLES = "${var.name}-"
    # snapshot=True replicas restore weights from, and write them to, the same bucket.
    EMBER_SNAPSHOT_STORE = "s3://${aws_s3_bucket.packages.bucket}/snapshots"
  }
  gateway_env = merge(local.node_env, {
    EMBER_AWS_ASG               = "${var.name}-nodes"
    EMBER_AWS_REPLICAS_PER_NODE = tostring(var.replicas_per_node)
  })
  account = data.aws_caller_identity.current.account_id
  region  = data.aws_region.current.name
}

data "aws_region" "current" {}

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

# One key encrypts the bucket, the tables, the log groups, the Redis data and its auth token.
resource "aws_kms_key" "ember" {
  description             = "${var.name}: packages, snapshots, tables, logs, Redis"
  enable_key_rotation     = true
  deletion_window_in_days = 7
  policy                  = data.aws_iam_policy_document.key.json
}

resource "aws_kms_alias" "ember" {
  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.ember.key_id
}

data "aws_iam_policy_document" "key" {
  #checkov:skip=CKV_AWS_109:in a key policy "*" is this key, and the account root must administer it (AWS default)
  #checkov:skip=CKV_AWS_111:in a key policy "*" is this key, and the account root must administer it (AWS default)
  #checkov:skip=CKV_AWS_356:a key policy's resource is always "*", meaning the key itself
  statement {
    sid       = "AccountAdministersTheKey"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${local.account}:root"]
    }
  }
  statement {
    sid       = "LogGroupsEncryptWithIt"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${local.region}.amazonaws.com"]
    }
    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${data.aws_partition.current.partition}:logs:${local.region}:${local.account}:log-group:*"]
    }
  }
}

resource "aws_s3_bucket" "packages" {
  #checkov:skip=CKV_AWS_144:`ember deploy` rebuilds packages and a first boot rebuilds snapshots; a copy doubles storage
  bucket_prefix = "${var.name}-packages-"
  force_destroy = var.force_destroy
}

resource "aws_s3_bucket_public_access_block" "packages" {
  bucket                  = aws_s3_bucket.packages.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "packages" {
  bucket = aws_s3_bucket.packages.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "packages" {
  bucket = aws_s3_bucket.packages.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.ember.arn
    }
    bucket_key_enabled = true # one KMS call per bucket key, not per object: snapshots are many ranged GETs
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "packages" {
  bucket = aws_s3_bucket.packages.id
  rule {
    id     = "old-versions-and-partial-uploads"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }
}

resource "aws_s3_bucket_logging" "packages" {
  bucket        = aws_s3_bucket.packages.id
  target_bucket = aws_s3_bucket.logs.id
  target_prefix = "s3/"
  depends_on    = [aws_s3_bucket_policy.logs] # S3 checks the logging service may write there
}

# Uploads (a deploy, a first snapshot) become EventBridge events an account can audit or act on.
resource "aws_s3_bucket_notification" "packages" {
  bucket      = aws_s3_bucket.packages.id
  eventbridge = true
}

# Access logs of the package bucket and the load balancer. Both services deliver only to SSE-S3 buckets.
resource "aws_s3_bucket" "logs" {
  #checkov:skip=CKV_AWS_145:S3 server access logs and ALB access logs can only be delivered to SSE-S3 (AES256) buckets
  #checkov:skip=CKV_AWS_18:this is the access-log bucket; logging it into itself would log its own log writes
  #checkov:skip=CKV_AWS_144:access logs are kept for audit in this region; replicating them doubles their cost
  #checkov:skip=CKV2_AWS_62:log deliveries are AWS's own writes; events for them would only echo every log line
  bucket_prefix = "${var.name}-logs-"
  force_destroy = var.force_destroy
}

resource "aws_s3_bucket_public_access_block" "logs" {
  bucket                  = aws_s3_bucket.logs.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "logs" {
  bucket = aws_s3_bucket.logs.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "logs" {
  bucket = aws_s3_bucket.logs.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "logs" {
  bucket = aws_s3_bucket.logs.id
  rule {
    id     = "expire-logs"
    status = "Enabled"
    filter {}
    expiration {
      days = var.log_retention_days
    }
    noncurrent_version_expiration {
      noncurrent_days = 1
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }
  }
}

data "aws_elb_service_account" "current" {}

data "aws_iam_policy_document" "logs_bucket" {
  statement {
    sid       = "LoadBalancerAccessLogs"
    actions   = ["s3:PutObject"]
    resources = ["${aws_s3_bucket.logs.arn}/alb/*"]
    principals {
      type        = "AWS"
      identifiers = [data.aws_elb_service_account.current.arn]
    }
  }
  statement {
    sid       = "BucketAccessLogs"
    actions   = ["s3:PutObject"]
    resources = ["${aws_s3_bucket.logs.arn}/s3/*"]
    principals {
      type        = "Service"
      identifiers = ["logging.s3.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account]
    }
  }
  statement {
    sid       = "TlsOnly"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.logs.arn, "${aws_s3_bucket.logs.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "logs" {
  bucket = aws_s3_bucket.logs.id
  policy = data.aws_iam_policy_document.logs_bucket.json
}

resource "aws_dynamodb_table" "nodes" {
  #checkov:skip=CKV2_AWS_16:on-demand (PAY_PER_REQUEST) tables scale by themselves; autoscaling is for provisioned
  name         = "${var.name}-nodes"
  billing_mode = "PAY_PER_REQUEST"
  hash_key     = "node_id"
  attribute {
    name = "node_id"
    type = "S"
  }
  point_in_time_recovery {
    enabled = true
  }
  server_side_encryption {
    enabled     = true
    kms_key_arn = aws_kms_key.ember.arn
  }
}

resource "aws_dynamodb_table" "replicas" {
  #checkov:skip=CKV2_AWS_16:on-demand (PAY_PER_REQUEST) tables scale by themselves; autoscaling is for provisioned
  name         = "${var.name}-replicas"
  billing_mode = "PAY_PER_REQUEST"
  hash_key     = "replica_id"
  attribute {
    name = "replica_id"
    type = "S"
  }
  point_in_time_recovery {
    enabled = true
  }
  server_side_encryption {
    enabled     = true
    kms_key_arn = aws_kms_key.ember.arn
  }
}

resource "aws_cloudwatch_log_group" "gateway" {
  name              = "/ember/${var.name}/gateway"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.ember.arn
}

resource "aws_cloudwatch_log_group" "nodes" {
  name              = "/ember/${var.name}/nodes"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.ember.arn
}
