# What `ember serve --backend aws` needs: the package bucket, the node and replica tables, a GPU node
# Auto Scaling Group whose desired capacity the gateway sets, and the gateway behind an HTTPS load balancer.

locals {
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
}

data "aws_region" "current" {}

resource "aws_s3_bucket" "packages" {
  bucket_prefix = "${var.name}-packages-"
}

resource "aws_s3_bucket_public_access_block" "packages" {
  bucket                  = aws_s3_bucket.packages.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_dynamodb_table" "nodes" {
  name         = "${var.name}-nodes"
  billing_mode = "PAY_PER_REQUEST"
  hash_key     = "node_id"
  attribute {
    name = "node_id"
    type = "S"
  }
}

resource "aws_dynamodb_table" "replicas" {
  name         = "${var.name}-replicas"
  billing_mode = "PAY_PER_REQUEST"
  hash_key     = "replica_id"
  attribute {
    name = "replica_id"
    type = "S"
  }
}

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
}

resource "aws_iam_role" "node" {
  name_prefix        = "${var.name}-node-"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
}

resource "aws_iam_role_policy" "node" {
  role   = aws_iam_role.node.id
  policy = data.aws_iam_policy_document.node.json
}

resource "aws_iam_instance_profile" "node" {
  name_prefix = "${var.name}-node-"
  role        = aws_iam_role.node.name
}

resource "aws_iam_role" "gateway" {
  name_prefix        = "${var.name}-gateway-"
  assume_role_policy = data.aws_iam_policy_document.ec2_assume.json
}

resource "aws_iam_role_policy" "gateway" {
  role   = aws_iam_role.gateway.id
  policy = data.aws_iam_policy_document.gateway.json
}

resource "aws_iam_instance_profile" "gateway" {
  name_prefix = "${var.name}-gateway-"
  role        = aws_iam_role.gateway.name
}

resource "aws_security_group" "alb" {
  name_prefix = "${var.name}-alb-"
  vpc_id      = var.vpc_id
  ingress {
    from_port   = 443
    to_port     = 443
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_security_group" "gateway" {
  name_prefix = "${var.name}-gateway-"
  vpc_id      = var.vpc_id
  ingress {
    from_port       = 8443
    to_port         = 8443
    protocol        = "tcp"
    security_groups = [aws_security_group.alb.id]
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_security_group" "node" {
  name_prefix = "${var.name}-node-"
  vpc_id      = var.vpc_id
  ingress { # replica workers listen on ephemeral ports; only the gateway reaches them
    from_port       = 1024
    to_port         = 65535
    protocol        = "tcp"
    security_groups = [aws_security_group.gateway.id]
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_launch_template" "node" {
  name_prefix   = "${var.name}-node-"
  image_id      = var.node_ami_id
  instance_type = var.node_instance_type
  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }
  vpc_security_group_ids = [aws_security_group.node.id]
  metadata_options {
    http_tokens = "required"
  }
  user_data = base64encode(templatefile("${path.module}/node_user_data.sh.tftpl", {
    env  = merge(local.node_env, { AWS_DEFAULT_REGION = data.aws_region.current.name }), ember = var.ember_version,
    gpus = var.node_gpus, slots = var.replicas_per_node
  }))
}

resource "aws_autoscaling_group" "nodes" {
  name                = "${var.name}-nodes"
  min_size            = 0
  max_size            = var.max_nodes
  desired_capacity    = 0
  vpc_zone_identifier = var.subnet_ids
  launch_template {
    id      = aws_launch_template.node.id
    version = "$Latest"
  }
  lifecycle {
    ignore_changes = [desired_capacity] # the gateway owns it
  }
}

resource "aws_launch_template" "gateway" {
  name_prefix   = "${var.name}-gateway-"
  image_id      = var.gateway_ami_id
  instance_type = var.gateway_instance_type
  iam_instance_profile {
    arn = aws_iam_instance_profile.gateway.arn
  }
  vpc_security_group_ids = [aws_security_group.gateway.id]
  metadata_options {
    http_tokens = "required"
  }
  user_data = base64encode(templatefile("${path.module}/gateway_user_data.sh.tftpl", {
    env    = merge(local.gateway_env, { AWS_DEFAULT_REGION = data.aws_region.current.name }), ember = var.ember_version,
    bucket = aws_s3_bucket.packages.bucket
  }))
}

resource "aws_lb" "gateway" {
  name_prefix        = substr(var.name, 0, 6)
  load_balancer_type = "application"
  subnets            = var.subnet_ids
  security_groups    = [aws_security_group.alb.id]
}

resource "aws_lb_target_group" "gateway" {
  name_prefix = substr(var.name, 0, 6)
  port        = 8443
  protocol    = "HTTPS"
  vpc_id      = var.vpc_id
  health_check {
    path     = "/readyz"
    protocol = "HTTPS"
  }
}

resource "aws_lb_listener" "https" {
  load_balancer_arn = aws_lb.gateway.arn
  port              = 443
  protocol          = "HTTPS"
  ssl_policy        = "ELBSecurityPolicy-TLS13-1-2-2021-06"
  certificate_arn   = var.certificate_arn
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.gateway.arn
  }
}

resource "aws_autoscaling_group" "gateway" {
  name                = "${var.name}-gateway"
  min_size            = 1
  max_size            = 1
  vpc_zone_identifier = var.subnet_ids
  target_group_arns   = [aws_lb_target_group.gateway.arn]
  launch_template {
    id      = aws_launch_template.gateway.id
    version = "$Latest"
  }
}
