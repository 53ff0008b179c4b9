# Instance roles: each can reach only this deployment's bucket, tables, key, log group (and, for the gateway, its
# Auto Scaling Group and the Redis auth token).

data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "node" {
  statement {
    actions   = ["s3:GetObject"]
    resources = ["${aws_s3_bucket.packages.arn}/*"]
  }
  statement {
    # A replica's first boot writes its weight snapshot (EMBER_SNAPSHOT_STORE=s3://BUCKET/snapshots).
    actions   = ["s3:PutObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.packages.arn}/snapshots/*"]
  }
  statement {
    # Without ListBucket, S3 answers 403 instead of 404 for a missing object.
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.packages.arn]
  }
  statement {
    actions   = ["dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:Scan"]
    resources = [aws_dynamodb_table.nodes.arn, aws_dynamodb_table.replicas.arn]
  }
  statement {
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.ember.arn]
  }
  statement {
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${aws_cloudwatch_log_group.nodes.arn}:*"]
  }
}

data "aws_iam_policy_document" "gateway" {
  statement {
    actions   = ["s3:GetObject", "s3:PutObject"]
    resources = ["${aws_s3_bucket.packages.arn}/*"]
  }
  statement {
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.packages.arn]
  }
  statement {
    actions   = ["dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:DeleteItem", "dynamodb:Scan"]
    resources = [aws_dynamodb_table.nodes.arn, aws_dynamodb_table.replicas.arn]
  }
  statement {
    actions   = ["autoscaling:DescribeAutoScalingGroups"]
    resources = ["*"] # Describe* calls take no resource-level permissions
  }
  statement {
    actions   = ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"]
    resources = [aws_autoscaling_group.nodes.arn]
  }
  statement {
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.ember.arn]
  }
  statement {
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${aws_cloudwatch_log_group.gateway.arn}:*"]
  }
  dynamic "statement" {
    for_each = aws_secretsmanager_secret.redis
    content {
      actions   = ["secretsmanager:GetSecretValue"]
      resources = [statement.value.arn]
    }
  }
}

locals {
  # Each kind of instance gets a role with its policy and an instance profile: the same three resources. The names
  # alone key the roles and profiles, so a profile does not wait on a policy (the gateway's names the node group,
  # whose launch template names the node profile).
  instance_kinds = toset(["node", "gateway"])
  instance_policies = {
    node    = data.aws_iam_policy_document.node.json
    gateway = data.aws_iam_policy_document.gateway.json
  }
}

resource "aws_iam_role" "instance" {
  for_each           = local.instance_kinds
  name_prefix        = "${var.name}-${each.key}-"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
}

resource "aws_iam_role_policy" "instance" {
  for_each = local.instance_kinds
  role     = aws_iam_role.instance[each.key].id
  policy   = local.instance_policies[each.key]
}

resource "aws_iam_instance_profile" "instance" {
  for_each    = local.instance_kinds
  name_prefix = "${var.name}-${each.key}-"
  role        = aws_iam_role.instance[each.key].name
}
