// Stand-in for Insight's CommonRequests.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
