# Launch templates and Auto Scaling Groups: GPU nodes (the gateway owns their desired capacity) and the gateways.

resource "aws_launch_template" "node" {
  name_prefix   = "${var.name}-node-"
  image_id      = var.node_ami_id
  instance_type = var.node_instance_type
  iam_instance_profile {
    arn = aws_iam_instance_profile.instance["node"].arn
  }
  vpc_security_group_ids = [aws_security_group.node.id]
  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }
  tag_specifications {
    resource_type = "instance"
    tags          = { Name = "${var.name}-node", "ember:role" = "node" }
  }
  user_data = base64encode(templatefile("${path.module}/node_user_data.sh.tftpl", {
    env       = merge(local.node_env, { AWS_DEFAULT_REGION = local.region }), ember = var.ember_version,
    gpus      = var.node_gpus, slots = var.replicas_per_node,
    log_group = aws_cloudwatch_log_group.nodes.name
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
  tag {
    key                 = "ember:role"
    value               = "node"
    propagate_at_launch = true
  }
  tag {
    key                 = "ember:deployment"
    value               = var.name
    propagate_at_launch = true
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
    arn = aws_iam_instance_profile.instance["gateway"].arn
  }
  vpc_security_group_ids = [aws_security_group.gateway.id]
  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }
  tag_specifications {
    resource_type = "instance"
    tags          = { Name = "${var.name}-gateway", "ember:role" = "gateway" }
  }
  user_data = base64encode(templatefile("${path.module}/gateway_user_data.sh.tftpl", {
    env    = merge(local.gateway_env, { AWS_DEFAULT_REGION = local.region }), ember = var.ember_version,
    bucket = aws_s3_bucket.packages.bucket, log_group = aws_cloudwatch_log_group.gateway.name,
    # EMBER_REDIS_URL is put together at boot: the auth token is read from Secrets Manager, never written here.
    redis_host   = local.redis ? aws_elasticache_replication_group.redis[0].primary_endpoint_address : "",
    redis_secret = local.redis ? aws_secretsmanager_secret.redis[0].arn : ""
  }))
}

resource "aws_autoscaling_group" "gateway" {
  name                      = "${var.name}-gateway"
  min_size                  = var.gateway_count
  max_size                  = var.gateway_count
  desired_capacity          = var.gateway_count
  vpc_zone_identifier       = var.subnet_ids
  target_group_arns         = [aws_lb_target_group.gateway.arn]
  health_check_type         = "ELB"
  health_check_grace_period = 300
  launch_template {
    id      = aws_launch_template.gateway.id
    version = "$Latest"
  }
  tag {
    key                 = "ember:role"
    value               = "gateway"
    propagate_at_launch = true
  }
  tag {
    key                 = "ember:deployment"
    value               = var.name
    propagate_at_launch = true
  }
}
