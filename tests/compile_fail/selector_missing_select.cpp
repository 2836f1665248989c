// expect: S is not a gradcomp::selector: it needs a member
// A policy that lacks a required member: this "selector" has no select(). The composition
// point must say so in one sentence instead of a page of template errors.
#include <gradcomp/feedback/residual.hpp>
#include <gradcomp/quantize/identity.hpp>
#include <gradcomp/step.hpp>

struct my_selector {
  double density = 0.01;  // but no select()
};

gradcomp::compressor<my_selector, gradcomp::identity, gradcomp::residual> c;
