# The HTTPS load balancer in front of the gateways: access logs, invalid headers dropped, a WAF web ACL with AWS's
# managed common and known-bad-inputs (Log4Shell) rules, and deletion protection unless turned off.

resource "aws_lb" "gateway" {
  #checkov:skip=CKV2_AWS_76:Log4j rules (KnownBadInputsRuleSet) are on; AnonymousIpList would block cloud clients
  name_prefix                = substr(var.name, 0, 6)
  load_balancer_type         = "application"
  subnets                    = var.subnet_ids
  security_groups            = [aws_security_group.alb.id]
  drop_invalid_header_fields = true
  enable_deletion_protection = var.deletion_protection
  access_logs {
    bucket  = aws_s3_bucket.logs.id
    prefix  = "alb"
    enabled = true
  }
  depends_on = [aws_s3_bucket_policy.logs] # the load balancer checks it may write there
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

resource "aws_wafv2_web_acl" "gateway" {
  count       = var.waf ? 1 : 0
  name        = "${var.name}-gateway"
  description = "${var.name}: AWS managed common and known-bad-inputs rules in front of the gateways"
  scope       = "REGIONAL"
  default_action {
    allow {}
  }
  rule {
    name     = "common"
    priority = 0
    override_action {
      none {}
    }
    statement {
      managed_rule_group_statement {
        vendor_name = "AWS"
        name        = "AWSManagedRulesCommonRuleSet"
        rule_action_override {
          name = "SizeRestrictions_BODY" # request bodies (prompts, batches) exceed 8 KB; the gateway bounds them
          action_to_use {
            count {}
          }
        }
      }
    }
    visibility_config {
      cloudwatch_metrics_enabled = true
      metric_name                = "${var.name}-common"
      sampled_requests_enabled   = true
    }
  }
  rule {
    name     = "known-bad-inputs"
    priority = 1
    override_action {
      none {}
    }
    statement {
      managed_rule_group_statement {
        vendor_name = "AWS"
        name        = "AWSManagedRulesKnownBadInputsRuleSet"
      }
    }
    visibility_config {
      cloudwatch_metrics_enabled = true
      metric_name                = "${var.name}-known-bad-inputs"
      sampled_requests_enabled   = true
    }
  }
  visibility_config {
    cloudwatch_metrics_enabled = true
    metric_name                = "${var.name}-gateway"
    sampled_requests_enabled   = true
  }
}

resource "aws_wafv2_web_acl_association" "gateway" {
  count        = var.waf ? 1 : 0
  resource_arn = aws_lb.gateway.arn
  web_acl_arn  = aws_wafv2_web_acl.gateway[0].arn
}

resource "aws_cloudwatch_log_group" "waf" {
  count             = var.waf ? 1 : 0
  name              = "aws-waf-logs-${var.name}" # WAF delivers only to groups named aws-waf-logs-*
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.ember.arn
}

resource "aws_wafv2_web_acl_logging_configuration" "gateway" {
  count                   = var.waf ? 1 : 0
  resource_arn            = aws_wafv2_web_acl.gateway[0].arn
  log_destination_configs = [aws_cloudwatch_log_group.waf[0].arn]
  redacted_fields {
    single_header {
      name = "authorization" # API keys stay out of the logs
    }
  }
}
